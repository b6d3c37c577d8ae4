"""Write the table of verl 0.9's keys that docs/from_verl.md's hand-written tables do not name, from
fsdptrain/config/verl_keys.yaml (one row a reason, its keys together), and the table of the defaults that are not
verl 0.9's, from fsdptrain/config/verl_defaults.yaml, between the page's markers.

    python scripts/verl_keys_doc.py          # rewrites the section in place
"""

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "from_verl.md"
TABLE = REPO / "fsdptrain" / "config" / "verl_keys.yaml"
DEFAULTS = REPO / "fsdptrain" / "config" / "verl_defaults.yaml"
BEGIN, END = "<!-- verl_keys_doc.py: begin -->", "<!-- verl_keys_doc.py: end -->"


def as_yaml(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def state(entry: dict) -> tuple[str, str]:
    name, why = plain_state(entry)
    implied = ", ".join(f"`{k}`" for k in entry.get("implies", []))
    return name, f"{why}; sets {implied} unless the command line sets it" if implied else why


def plain_state(entry: dict) -> tuple[str, str]:
    if "mapped" in entry:
        return "mapped", f"`{entry['mapped']}`"
    if "accepted" in entry:
        return "accepted", " ".join(str(entry["accepted"]).split())
    if "group" in entry:
        return f"config group: `{entry['group']}` taken, others refused", " ".join(str(entry["refused"]).split())
    if "refused" in entry:
        unless = entry.get("unless")
        off = ", ".join(f"`{as_yaml(v)}`" for v in (unless if isinstance(unless, list) else [unless]))
        return (f"refused unless {off}" if "unless" in entry else "refused"), " ".join(str(entry["refused"]).split())
    if entry.get("world_size"):
        return "world size", "checked against torchrun's world size; without torchrun, the trainer starts that many workers (one node)"
    return "value mapped", " ".join(str(entry.get("reason", "")).split())


def section(hand_written: str) -> str:
    lines = [BEGIN, "", "The rest of verl 0.9's keys (a `*` stands for any one part of a key; a key covers every key under it):", ""]
    for trainer, entries in yaml.safe_load(TABLE.read_text()).items():
        rows: dict[tuple[str, str], list[str]] = {}
        for key, entry in entries.items():
            if f"`{key}`" not in hand_written:
                rows.setdefault(state(entry), []).append(key)
        lines += [f"**{'GRPO' if trainer == 'grpo' else 'SFT'}**", "", "| verl keys | state | here |", "|---|---|---|"]
        lines += [f"| {', '.join(f'`{k}`' for k in keys)} | {name} | {why} |" for (name, why), keys in rows.items()]
        lines.append("")
    lines += ["### Defaults that are not verl 0.9's", "",
              "Of the keys fsdptrain shares with verl 0.9, those whose default differs (`fsdptrain/config/verl_defaults.yaml`; "
              "`python -m fsdptrain.check` names those a command line leaves unset, but for the ones marked *no effect*: "
              "another spelling of verl's default, or a key verl requires).", ""]
    for trainer, entries in yaml.safe_load(DEFAULTS.read_text()).items():
        lines += [f"**{'GRPO' if trainer == 'grpo' else 'SFT'}**", "", "| key | verl 0.9 | why |", "|---|---|---|"]
        lines += [f"| `{key}` | `{as_yaml(entry['verl'])}` | {' '.join(entry['why'].split())}{' (no effect)' if entry.get('quiet') else ''} |"
                  for key, entry in entries.items()]
        lines.append("")
    return "\n".join([*lines, END])


def main() -> None:
    page = PAGE.read_text()
    head, _, rest = page.partition(BEGIN)
    _, _, tail = rest.partition(END)
    PAGE.write_text(head + section(head + tail) + tail)


if __name__ == "__main__":
    main()
