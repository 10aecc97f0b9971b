"""A Hugging Face causal LM trained through cce_compile: compile the step, not the model.

    python examples/hf_causal_lm.py        # tiny random Llama, a few steps, CPU or GPU

Compiling the step that turns (input_ids, labels) into the loss lets the logits die inside the
graph, so the pass can fuse lm_head and the loss; compiling the model itself returns the logits,
and cce_compile.explain() says so.
"""

import torch
import transformers

import cce_compile

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


def step(input_ids, labels):
    return model(input_ids=input_ids, labels=labels).loss


ids = torch.randint(0, config.vocab_size, (4, 128), device=device)
print(cce_compile.explain(step, ids, ids))  # one site, rewritten
print(
    cce_compile.explain(model, input_ids=ids, labels=ids)
)  # logits escape: left alone, with a fix

compiled = torch.compile(step, backend=cce_compile.backend)
for i in range(5):
    loss = compiled(ids, ids)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {i}: loss {loss.item():.4f}")
