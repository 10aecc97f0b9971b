"""No cce_compile import at all: run as `CCE_COMPILE=1 python examples/plain_compile_env.py`.

The package's start-up hook installs the pass at the first torch.compile, so a plain
torch.compile(fn) gets it. The counters show whether a site was rewritten (0 without
CCE_COMPILE=1).
"""

import argparse


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()

    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    lm_head = torch.nn.Linear(64, 5000, bias=False)
    hidden = torch.randn(8, 128, 64, requires_grad=True)
    targets = torch.randint(0, 5000, (8, 128))

    @torch.compile
    def loss_fn(hidden, targets):
        logits = lm_head(hidden)
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))

    loss_fn(hidden, targets).backward()
    print("rewritten sites:", counters["cce_compile"]["rewritten"])


if __name__ == "__main__":
    main()
