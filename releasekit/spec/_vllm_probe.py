"""Runs inside the interpreter that serves vLLM (by file path, so it needs vLLM and the
standard library only, never releasekit): reads the OpenAI server's own argument parser
(`make_arg_parser(FlexibleArgumentParser())`, which adds `FrontendArgs` and
`AsyncEngineArgs.add_cli_args`) and prints JSON on stdout.

    echo '{"table": true, "pairs": [["--max-num-seqs", "many"]]}' | python _vllm_probe.py
    -> {"table": {"vllm_version": ..., "options": [...]}, "checks": [problem or null, ...]}

Each [flag, value] pair (value null: a bare flag) is parsed on its own with the real parser,
so every bad argument is named, not only the first. One run does both, because importing
vLLM is the slow part (seconds).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

_STANDARD = {
    "_StoreAction",
    "_StoreTrueAction",
    "_StoreFalseAction",
    "_StoreConstAction",
    "_AppendAction",
    "_CountAction",
    "BooleanOptionalAction",
}
_SIMPLE = {"int", "float", "str", "human_readable_int", "human_readable_int_or_auto", "loads"}


MARKER = "@@RELEASEKIT-JSON@@"


class _Rejected(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    au = importlib.import_module("vllm.utils.argparse_utils")
    cli = importlib.import_module("vllm.entrypoints.launchers.cli_args")

    class Strict(au.FlexibleArgumentParser):  # type: ignore[misc,name-defined]
        def error(self, message: str) -> Any:
            raise _Rejected(message)

    return cli.make_arg_parser(Strict())  # type: ignore[no-any-return]


def _type_of(t: Any) -> tuple[str, bool]:
    """(simple type name or "other", accepts "None"/"" as None) of an argparse type."""
    if t is None:
        return "str", False
    optional = False
    for _ in range(4):  # unwrap vLLM's optional_type(parse_type(T)) closures
        name = getattr(t, "__name__", "")
        if name == "_optional_type":
            optional = True
        if name in ("_optional_type", "_parse_type") and t.__closure__:
            t = t.__closure__[0].cell_contents
            continue
        break
    name = getattr(t, "__name__", "")
    return (name if name in _SIMPLE else "other"), optional


def _jsonable(values: Any) -> list[Any] | None:
    try:
        out = list(values)
        json.dumps(out)
    except (TypeError, ValueError):
        return None
    return out


def table() -> dict[str, Any]:
    """Every option of the server's parser: flags, kind, type, nargs, choices, default."""
    import vllm

    options = []
    for a in _parser()._actions:
        if not a.option_strings or isinstance(a, argparse._HelpAction):
            continue
        kind = "flag" if a.nargs == 0 else "value"
        if a.nargs == "?" and a.const is not None:
            kind = "flag_or_value"
        type_name, optional = _type_of(a.type)
        choices = None if a.choices is None else _jsonable(a.choices)
        if type(a).__name__ not in _STANDARD or (a.choices is not None and choices is None):
            type_name = "other"
        options.append(
            {
                "flags": list(a.option_strings),
                "dest": a.dest,
                "kind": kind,
                "type": type_name,
                "optional": optional,
                "nargs": a.nargs if isinstance(a.nargs, int | str | None) else None,
                "choices": choices,
                "default_on": a.default is True,
                "negatable": type(a).__name__ == "BooleanOptionalAction",
            }
        )
    return {"vllm_version": getattr(vllm, "__version__", "unknown"), "options": options}


def check(pairs: list[list[str | None]]) -> list[str | None]:
    """The real parser's complaint about each [flag, value] (value None: a bare flag)."""
    parser = _parser()
    out: list[str | None] = []
    for flag, value in pairs:
        argv = [str(flag)] if value is None else [str(flag), str(value)]
        try:
            parser.parse_args(argv)
        except _Rejected as exc:
            out.append(str(exc))
        except Exception as exc:  # a type function that raised something else
            out.append(f"{type(exc).__name__}: {exc}")
        else:
            out.append(None)
    return out


def main() -> None:
    request = json.loads(sys.stdin.read() or "{}")
    result = {
        "table": table() if request.get("table", True) else None,
        "checks": check(request.get("pairs", [])),
    }
    # vLLM may log to stdout while importing: the marker separates the answer from that.
    sys.stdout.write("\n" + MARKER + json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
