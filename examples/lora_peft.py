"""LoRA fine-tuning with PEFT, the loss fused by cce_compile.

    python examples/lora_peft.py                      # tiny random Llama, CPU or GPU
    python examples/lora_peft.py --device cpu --steps 5 --activation-checkpointing

Nothing PEFT-specific is set: compile the step that returns the loss with backend="cce" (or
call cce_compile.enable() / run with CCE_COMPILE=1 and compile it plainly). The frozen head gets
no gradient work: the fused op computes the hidden states' gradient only. With activation
checkpointing, transformers hooks the (frozen) embeddings with requires_grad_(), which cuts the
graph; non-reentrant checkpointing does not need that hook, so it is removed (docs/stacks.md).
"""

import argparse


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--activation-checkpointing", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = parse_args()  # before the heavy imports: --help answers at once

    import peft
    import torch
    import transformers

    import cce_compile

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    config = transformers.LlamaConfig(  # random weights from a config: nothing is downloaded
        vocab_size=32000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    base = transformers.LlamaForCausalLM(config).to(device)
    # lm_head stays frozen: keep it out of target_modules (a LoRA head is not fused).
    lora = peft.LoraConfig(task_type="CAUSAL_LM", r=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, lora)
    if args.activation_checkpointing:
        model.activation_checkpointing_enable()  # non-reentrant by default
        model.disable_input_require_grads()  # its hook would cut the graph
    model.print_trainable_parameters()

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (4, 128), device=device)

    def step(input_ids, labels):
        return model(input_ids=input_ids, labels=labels).loss

    compiled = torch.compile(step, backend="cce")
    with cce_compile.watch() as report:
        for i in range(args.steps):
            loss = compiled(ids, ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            print(f"step {i}: loss {loss.item():.4f}")
    print(report)  # the loss is REWRITTEN; the logits memory it saves

    # After training: fold the adapters into the base weights and evaluate the plain model.
    merged = model.merge_and_unload().eval()

    def evaluate(input_ids, labels):
        with torch.no_grad():
            return merged(input_ids=input_ids, labels=labels).loss

    eager = evaluate(ids, ids)
    fused = torch.compile(evaluate, backend="cce")(ids, ids)
    print(f"merged model, evaluation loss: {fused.item():.5f} fused, {eager.item():.5f} eager")


if __name__ == "__main__":
    main()
