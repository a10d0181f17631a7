"""Create the synthetic arithmetic dataset (corpus, JSONL splits, SentencePiece tokenizer).

    python tools/make_synthetic_data.py --out .data/synthetic [--num-train 20000] [--seed 0]

Deterministic: the same arguments give byte-identical files on any machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_logra.data.dataset_dir import META_FILE, SyntheticDataSpec, write_synthetic_dataset


def main() -> None:
    defaults = SyntheticDataSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="dataset directory to create or replace")
    parser.add_argument("--num-train", type=int, default=defaults.num_train)
    parser.add_argument("--num-eval", type=int, default=defaults.num_eval)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--max-digits", type=int, default=defaults.max_digits)
    args = parser.parse_args()
    spec = SyntheticDataSpec(
        num_train=args.num_train, num_eval=args.num_eval, seed=args.seed,
        vocab_size=args.vocab_size, max_digits=args.max_digits,
    )
    out = write_synthetic_dataset(args.out, spec)
    meta = json.loads((Path(out) / META_FILE).read_text())
    print(f"wrote {out}: {meta['num_tokens']} tokens, vocabulary {meta['vocab_size']}")


if __name__ == "__main__":
    main()
