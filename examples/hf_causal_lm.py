"""A Hugging Face causal LM trained through cce_compile, in the two recipes.

    python examples/hf_causal_lm.py                   # tiny random Llama, a few steps, CPU or GPU
    python examples/hf_causal_lm.py --device cpu --steps 2

1. Compile the step that turns (input_ids, labels) into the loss: the logits die inside the
   graph, so the pass fuses lm_head and the loss.
2. Compile the model itself (what Trainer and most scripts do): it returns its logits too; with
   no setting the training loss is fused and the logits come back as a LogitsNotComputed
   placeholder that holds no memory (reading a value raises one error naming
   CCE_ESCAPING_LOGITS=rewrite / keep). explain() says which applies and why.
Nothing is downloaded: the model is built from a config with random weights.
"""

import argparse


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--steps", type=int, default=3, help="training steps per recipe")
    return parser.parse_args()


def main() -> None:
    args = parse_args()  # before the heavy imports: --help answers at once

    import torch
    import transformers

    import cce_compile

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ids = torch.randint(0, config.vocab_size, (4, 128), device=device)

    def step(input_ids, labels):
        return model(input_ids=input_ids, labels=labels).loss

    print(cce_compile.explain(step, ids, ids))  # one site, rewritten
    print(cce_compile.explain(model, input_ids=ids, labels=ids))  # logits escape: fix named

    # Recipe 1: the step.
    compiled = torch.compile(step, backend=cce_compile.backend)
    for i in range(args.steps):
        loss = compiled(ids, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {i}: loss {loss.item():.4f}")

    # Recipe 2: the whole model; its returned training logits are a placeholder (the default).
    model.compile(backend="cce")
    with cce_compile.watch() as report:
        for i in range(args.steps):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            print(f"whole model {i}: loss {out.loss.item():.4f}, logits on {out.logits.device}")
    print(report)


if __name__ == "__main__":
    main()
