"""The run-name tag of a sweep's runs: which result-changing settings the user's extra arguments change.

    python scripts/run_tag.py main-MLP-M4.py [SORTER ...] -- FIXED_ARGS ... -- EXTRA_ARGS ...
    # e.g. ... main-MLP-M4.py CD-GraB -- --lr 1e-3 --node_cnt 4 --B 16 --epochs 50 -- --sketch-dim 64
    # prints -sketch-dim64

Prints engine.cli.sweep_tags of the entry script's own parser (its make_parser()): out_tags of
FIXED_ARGS + EXTRA_ARGS against FIXED_ARGS, "" (an empty line) when the extra arguments change no
result-changing setting. With SORTERs, the extra arguments are first checked as each sorter's runs will
take them. A bad extra argument: the entry script's one-line error, exit status 2.
scripts/sweep-common.sh runs it once per sweep, fed on stdin (`$PYTHON - ARGS < scripts/run_tag.py`),
so it finds the repository from the entry script's path, not from its own.
"""
import importlib.util
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    if "--" not in argv or "--" not in argv[argv.index("--") + 1:]:
        print("usage: run_tag.py main-<BENCHMARK>.py [SORTER ...] -- FIXED_ARGS ... -- EXTRA_ARGS ...", file=sys.stderr)
        sys.exit(2)
    first = argv.index("--")
    second = argv.index("--", first + 1)
    (script, *sorters), fixed, extra = argv[:first], argv[first + 1:second], argv[second + 1:]
    script = Path(script).resolve()
    sys.path.insert(0, str(script.parent))  # the repository root, beside the entry scripts
    from engine.cli import sweep_tags
    from common.errors import UserFacingError, exit_with_error

    spec = importlib.util.spec_from_file_location(script.stem.replace("-", "_"), script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not as __main__: defines make_parser, runs nothing
    parser = module.make_parser()
    parser.prog = script.name  # its errors say "see main-<BENCHMARK>.py --help"
    try:
        print(sweep_tags(parser, module.BENCHMARK, fixed, extra, sorters))
    except UserFacingError as error:
        exit_with_error(str(error))


if __name__ == "__main__":
    main(sys.argv[1:])
