"""``--help`` shows every default, and a mistyped flag prints its own subcommand's usage."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from m2serve.serve.cli import build_parser

pytestmark = pytest.mark.slow  # starts server processes

EXE = str(Path(sys.executable).with_name("m2serve"))


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_option_of_every_subcommand_shows_its_default():
    subs = _subcommands(build_parser())
    assert set(subs) == {"serve", "generate", "plan", "build-kernels"}
    missing = []
    for name, sp in subs.items():
        for act in sp._actions:
            if act.dest == "help":
                continue
            # "(default" with or without the colon: a hand-written "(default none)" next to
            # argparse's "(default: none)" shows the default twice
            if (act.help or "").count("(default") != 1 or "; default:" in (act.help or ""):
                missing.append(f"{name} {'/'.join(act.option_strings) or act.dest}: {act.help!r}")
    assert not missing, "options whose --help shows no default (or two):\n" + "\n".join(missing)


@pytest.mark.parametrize("command", ["serve", "generate", "plan"])
def test_help_text_prints_the_defaults(command):
    r = subprocess.run([EXE, command, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    text = " ".join(r.stdout.split())  # argparse wraps lines
    assert f"usage: m2serve {command}" in text
    assert ("--max-batch-input-tokens MAX_BATCH_INPUT_TOKENS, --max-num-batched-tokens "
            "MAX_BATCH_INPUT_TOKENS tokens per step, prefill chunks and decodes together "
            "(default: 8192)") in text
    if command == "serve":
        assert "--port PORT port to listen on (0 = any free port) (default: 8000)" in text
        assert "--host HOST address to listen on (default: 127.0.0.1)" in text


@pytest.mark.parametrize("command, flag", [("serve", "--prot"), ("generate", "--max-tokns"),
                                           ("plan", "--bogus"),
                                           ("generate", "--max-token")])  # a prefix is no abbreviation
def test_mistyped_flag_prints_its_subcommand_usage(command, flag):
    r = subprocess.run([EXE, command, flag, "8001"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith(f"usage: m2serve {command} "), r.stderr
    assert f"m2serve {command}: error: unrecognized arguments: {flag}" in r.stderr


def test_every_flag_has_a_description():
    # issue 26 item 8: "(default: ...)" alone is not a description
    parser = build_parser()
    subs = _subcommands(parser)
    sub_action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert all(c.help for c in sub_action._choices_actions), "a subcommand without a description"
    bare = []
    for name, p in [("m2serve", parser), *subs.items()]:
        for act in p._actions:
            if act.dest == "help" or isinstance(act, argparse._SubParsersAction):
                continue
            if len((act.help or "").split("(default:")[0].strip()) < 3:
                bare.append(f"{name} {'/'.join(act.option_strings) or act.dest}: {act.help!r}")
    assert not bare, "flags without a description:\n" + "\n".join(bare)


def test_version_flag():
    import m2serve

    r = subprocess.run([EXE, "--version"], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip()) == (0, f"m2serve {m2serve.__version__}")


def test_every_subcommand_help_says_what_it_does():
    # `m2serve build-kernels --help` printed a bare usage line: each subcommand's own --help now opens
    # with the line `m2serve --help` lists for it
    parser = build_parser()
    sub_action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for choice in sub_action._choices_actions:
        text = " ".join(sub_action.choices[choice.dest].format_help().split())
        assert choice.help and choice.help in text, (choice.dest, text)
