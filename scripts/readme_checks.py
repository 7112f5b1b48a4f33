"""Print, or with --write refresh, the README's table of checks from the registry."""
import pathlib
import sys

from preflight import registry
from preflight.cli import checks_table

BEGIN, END = "<!-- checks:begin -->", "<!-- checks:end -->"
README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def current_table() -> str:
    text = README.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


def main() -> int:
    table = checks_table(registry.load().checks)
    if "--write" not in sys.argv:
        print(table)
        return 0
    text = README.read_text()
    head, rest = text.split(BEGIN, 1)
    README.write_text(f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
