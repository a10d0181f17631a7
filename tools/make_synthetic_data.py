"""Create the synthetic arithmetic dataset (corpus, JSONL splits, SentencePiece tokenizer).

    python tools/make_synthetic_data.py --out .data/synthetic [--num-train 20000] [--seed 0]
        [--operations plus,minus] [--min-digits 1] [--max-digits 3] [--zero-pad]

Deterministic: the same arguments give byte-identical files on any machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_logra.data.dataset_dir import META_FILE, SyntheticDataSpec, write_synthetic_dataset
from megatron_logra.data.synthetic import OPERATIONS


def main() -> None:
    defaults = SyntheticDataSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="dataset directory to create or replace")
    parser.add_argument("--num-train", type=int, default=defaults.num_train)
    parser.add_argument("--num-eval", type=int, default=defaults.num_eval)
    parser.add_argument("--num-valid", type=int, default=defaults.num_valid,
                        help="validation problems for choosing settings (valid.jsonl)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--min-digits", type=int, default=defaults.min_digits)
    parser.add_argument("--max-digits", type=int, default=defaults.max_digits)
    parser.add_argument("--operations", default=",".join(defaults.operations),
                        help=f"comma-separated subset of {','.join(OPERATIONS)}")
    parser.add_argument("--zero-pad", action="store_true",
                        help="write operands with exactly --max-digits digits (leading zeros)")
    args = parser.parse_args()
    spec = SyntheticDataSpec(
        num_train=args.num_train, num_eval=args.num_eval, num_valid=args.num_valid,
        seed=args.seed,
        vocab_size=args.vocab_size, min_digits=args.min_digits, max_digits=args.max_digits,
        operations=tuple(op.strip() for op in args.operations.split(",") if op.strip()),
        zero_pad=args.zero_pad,
    )
    try:
        out = write_synthetic_dataset(args.out, spec)
    except ValueError as error:
        parser.error(str(error))
    meta = json.loads((Path(out) / META_FILE).read_text())
    print(f"wrote {out}: {meta['num_tokens']} tokens, vocabulary {meta['vocab_size']}")


if __name__ == "__main__":
    main()
