"""Text from a checkpoint, for a sanity look at a run or an import (not an inference server).

    python -m train.checkpoint.sample RUN_OR_CHECKPOINT_DIR --prompt "..." [--tokens 64]
        [--top-p 0.9] [--temperature 0] [--seed 0] [--step N] [--tokenizer DIR|byte] [--device cpu]

Loads the checkpoint's model in one process (`train.checkpoint.export_hf.load_model`: the latest
complete checkpoint of a run directory unless `--step`), encodes the prompt with the run's tokenizer
(`RUN_DIR/tokenizer/` from an import, else the run's `data.tokenizer`, else byte) and adds one
token at a time, recomputing the whole forward each time (no KV cache): greedy at temperature 0
(the default), else nucleus sampling (the smallest set of most likely tokens whose probability
reaches `--top-p`). It stops at the tokenizer's EOS. Prints the prompt and its continuation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from model.config import ConfigError
from train.checkpoint.export_hf import ExportError, load_model, resolve_checkpoint


def next_token(logits: torch.Tensor, temperature: float, top_p: float,
               generator: torch.Generator | None = None) -> int:
    """Greedy (temperature 0) or nucleus sampling from one position's logits [V]."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    p, idx = probs.sort(descending=True)
    keep = p.cumsum(0) - p < top_p  # every token needed to reach top_p, at least the first
    p = p * keep
    return int(idx[torch.multinomial(p / p.sum(), 1, generator=generator)])


@torch.no_grad()
def generate(model, ids: list[int], tokens: int, eos_id: int | None = None,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             device: str = "cpu") -> list[int]:
    """`ids` continued by up to `tokens` tokens (stopping after `eos_id`)."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    out = list(ids)
    for _ in range(tokens):
        x = torch.tensor([out], device=device)
        logits = model.lm_head(model.hidden_states(x))[0, -1].float().cpu()
        out.append(next_token(logits, temperature, top_p, g))
        if out[-1] == eos_id:
            break
    return out


def run_tokenizer(run_or_ckpt: Path, explicit: str | None):
    """The tokenizer a run was trained with (see the module docstring)."""
    import yaml

    from data.tokenizer import load_tokenizer

    if explicit:
        return load_tokenizer(explicit)
    run = run_or_ckpt.parent.parent if run_or_ckpt.parent.name == "checkpoints" else run_or_ckpt
    if (run / "tokenizer").is_dir():
        return load_tokenizer(run / "tokenizer")
    if (run / "config.yaml").is_file():
        spec = (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("data", {})
        return load_tokenizer(spec.get("tokenizer", "byte"))
    return load_tokenizer("byte")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.checkpoint.sample",
                                description=__doc__.split("\n")[0])
    p.add_argument("source", type=Path, help="run directory or checkpoint directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokens", type=int, default=64, help="tokens to add (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--tokenizer", default=None, help="default: the run's")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    try:
        if args.tokens < 0 or not 0 < args.top_p <= 1:
            raise ExportError("--tokens must be >= 0 and --top-p in (0, 1]")
        ckpt = resolve_checkpoint(args.source, args.step)
        tok = run_tokenizer(args.source, args.tokenizer)
        model, _ = load_model(ckpt)
        if tok.vocab_size > model.config.vocab_size:
            raise ExportError(f"the tokenizer has {tok.vocab_size} ids, the model "
                              f"{model.config.vocab_size}; pass --tokenizer (the run's)")
        model.to(args.device)
        ids = tok.encode(args.prompt)
        if not ids:
            raise ExportError("--prompt encodes to no tokens; give some text")
        out = generate(model, ids, args.tokens, tok.eos_id, args.temperature, args.top_p,
                       args.seed, args.device)
    except (ExportError, ConfigError, OSError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"sample: error: {msg}", file=sys.stderr)
        return 2
    print(tok.decode(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
