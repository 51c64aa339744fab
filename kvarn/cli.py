"""The ``kvarn`` command: ``kvarn demo`` and ``kvarn report``."""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": "quantize a synthetic KV cache shaped like a real one, compare every preset with RTN baselines",
    "report": "measure fidelity on a real small model against baselines (writes report.md and plots)",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        out = sys.stdout if argv else sys.stderr  # asked-for help to stdout, a missing command is an error
        print("usage: kvarn {demo,report} [options]\n", file=out)
        for name, text in COMMANDS.items():
            print(f"  {name:<8} {text}", file=out)
        print("\n`kvarn COMMAND --help` describes a command's options.", file=out)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from kvarn.demo import main as run
    elif command == "report":
        from kvarn.eval.report import main as run
    else:
        print(f"kvarn: unknown command {command!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    raise SystemExit(main())
