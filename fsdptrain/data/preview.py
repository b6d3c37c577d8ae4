"""Show rows of a data file as the trainer will see them: the rendered tokens with the trained ones marked.

    python -m fsdptrain.data.preview FILE --tokenizer DIR [--rows 0,3] [--json] [data.KEY=VALUE ...]

The data keys are the trainer's (data.multiturn.enable, data.max_length, data.truncation,
data.apply_chat_template_kwargs, ...), with the same defaults. Trained tokens are green on a terminal and between
[[ and ]] otherwise; --json prints one object per sample with its input_ids and loss_mask.
"""

import argparse
import json
import sys

from omegaconf import OmegaConf
from transformers import AutoTokenizer

from fsdptrain.config.base import defaults, to_typed
from fsdptrain.config.sft import DataConfig, validate_data
from fsdptrain.data.chat import RowError
from fsdptrain.data.dataset import read_data_columns, row_values, tokenize_row, truncate
from fsdptrain.errors import ConfigError

GREEN, RESET = "\033[42;30m", "\033[0m"


def marked_text(tokenizer, ids: list[int], mask: list[int], colour: bool) -> str:
    """The rendered text, each run of trained tokens marked."""
    opening, closing = (GREEN, RESET) if colour else ("[[", "]]")
    parts, start = [], 0
    while start < len(ids):
        end = start
        while end < len(ids) and mask[end] == mask[start]:
            end += 1
        text = tokenizer.decode(ids[start:end])
        parts.append(f"{opening}{text}{closing}" if mask[start] else text)
        start = end
    return "".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--tokenizer", required=True, help="a folder with the tokenizer (usually the model's)")
    parser.add_argument("--rows", default="0", help="comma-separated row numbers (default: 0)")
    parser.add_argument("--json", action="store_true", help="one JSON object per sample instead of text")
    parser.add_argument("overrides", nargs="*", help="data.KEY=VALUE, as on the trainer's command line")
    args = parser.parse_intermixed_args(argv)
    bad = [o for o in args.overrides if not o.startswith("data.") or "=" not in o]
    if bad:
        parser.error(f"overrides must be data.KEY=VALUE, got {bad}")
    data = OmegaConf.merge(defaults("sft_trainer").data, OmegaConf.from_dotlist([o[len("data.") :] for o in args.overrides]))
    data.train_files = args.file
    try:
        config = to_typed(data, DataConfig)
        validate_data(config)
    except ConfigError as e:
        raise SystemExit(f"data.{e}" if not str(e).startswith("data.") else str(e)) from None
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    columns = read_data_columns(args.file, config)
    count = len(next(iter(columns.values())))
    colour = sys.stdout.isatty() and not args.json
    for row in (int(r) for r in args.rows.split(",")):
        if not 0 <= row < count:
            raise SystemExit(f"{args.file} has rows 0..{count - 1}, not {row}")
        try:
            samples = [truncate(ids, mask, config.max_length, config.truncation) for ids, mask in tokenize_row(tokenizer, config, row_values(columns, row))]
        except RowError as e:
            raise SystemExit(f"{args.file} row {row}: {e}") from None
        for part, (ids, mask) in enumerate(samples):
            if args.json:
                print(json.dumps({"row": row, "sample": part, "input_ids": ids, "loss_mask": mask}))
                continue
            trained = sum(mask[1:])
            note = " (not trained: no target left)" if trained == 0 else ""
            print(f"=== {args.file} row {row}, sample {part}: {len(ids)} tokens, {trained} trained{note}")
            print(marked_text(tokenizer, ids, mask, colour))


if __name__ == "__main__":
    main()
