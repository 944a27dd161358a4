"""Man pages and bash completion generated from the command lines' own parsers, so they never
drift from `--help` (the Debian package ships them; scripts/build_deb.sh).

    python scripts/gen_docs.py OUT_DIR      (with a python that has vaccel installed)

writes OUT_DIR/vaccel.1, OUT_DIR/vaccel-brokerd.8 and OUT_DIR/vaccel.bash-completion.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vaccel.cli.full import build_parser as client_parser

from brokerd import __version__
from brokerd.daemon.main import build_parser as broker_parser

SEE_ALSO = {"vaccel": "vaccel-brokerd (8)", "vaccel-brokerd": "vaccel (1), systemctl (1), journalctl (1)"}


def roff(text: str) -> str:
    """Plain text as roff: backslashes escaped, no line read as a request, blank lines kept."""
    out = []
    for line in text.replace("\\", "\\e").splitlines():
        line = line.replace("-", "\\-")
        out.append("\\&" + line if line.startswith((".", "'")) else line)
    return "\n".join(out).replace("\n\n", "\n.PP\n") if out else ""


def _options(parser: argparse.ArgumentParser) -> list[str]:
    lines = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            metavar = "" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}"
            name = ", ".join(f"\\fB{roff(o)}\\fR{roff(metavar) if metavar else ''}" for o in action.option_strings)
        else:
            name = f"\\fI{roff(str(action.metavar or action.dest))}\\fR"
        help_text = (action.help or "") % {"default": action.default, "prog": parser.prog} if action.help else ""
        if action.choices and not isinstance(action.choices, dict):
            help_text += f" (one of: {', '.join(map(str, action.choices))})"
        lines += [".TP", name, roff(help_text)]
    return lines


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def man_page(parser: argparse.ArgumentParser, section: int, summary: str) -> str:
    name = parser.prog
    lines = [f'.TH {name.upper()} {section} "" "vaccel {__version__}" "vaccel"', ".SH NAME",
             f"{roff(name)} \\- {roff(summary)}", ".SH SYNOPSIS", ".nf",
             roff(parser.format_usage().removeprefix("usage: ").strip()), ".fi", ".SH DESCRIPTION",
             ".nf", roff(parser.description or ""), ".fi", ".SH OPTIONS", *_options(parser)]
    commands = _commands(parser)
    if commands:
        lines.append(".SH COMMANDS")
        for command, sub in commands.items():
            lines += [f".SS {roff(command)}", ".nf", roff(sub.format_usage().removeprefix("usage: ").strip()), ".fi",
                      roff(sub.description or ""), *_options(sub)]
            if sub.epilog:
                lines += [".PP", ".nf", roff(sub.epilog), ".fi"]
    lines += [".SH SEE ALSO", SEE_ALSO[name], ""]
    return "\n".join(lines)


def bash_completion(parser: argparse.ArgumentParser) -> str:
    """`vaccel <TAB>` completes the commands, `vaccel run --<TAB>` that command's options,
    and a file name where an option takes a value."""
    commands = _commands(parser)
    top = " ".join(o for a in parser._actions for o in a.option_strings)
    cases = []
    for command, sub in commands.items():
        options = " ".join(o for a in sub._actions for o in a.option_strings)
        cases.append(f"        {command}) opts=\"{options}\" ;;")
    return "\n".join([
        "# bash completion for vaccel, generated from its parser by scripts/gen_docs.py",
        "_vaccel() {",
        "    local cur=${COMP_WORDS[COMP_CWORD]} command='' word opts",
        "    for word in \"${COMP_WORDS[@]:1:COMP_CWORD-1}\"; do",
        "        [[ $word == -* ]] || { command=$word; break; }",
        "    done",
        "    if [[ -z $command ]]; then",
        f"        if [[ $cur == -* ]]; then opts=\"{top}\"; else opts=\"{' '.join(commands)}\"; fi",
        "        COMPREPLY=($(compgen -W \"$opts\" -- \"$cur\"))",
        "        return",
        "    fi",
        "    case $command in",
        *cases,
        "        *) opts='' ;;",
        "    esac",
        "    if [[ $cur == -* ]]; then",
        "        COMPREPLY=($(compgen -W \"$opts\" -- \"$cur\"))",
        "    else",
        "        COMPREPLY=($(compgen -f -- \"$cur\"))",
        "    fi",
        "}",
        "complete -o filenames -F _vaccel vaccel",
        ""])


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "build/docs")
    out.mkdir(parents=True, exist_ok=True)
    client = client_parser()
    (out / "vaccel.1").write_text(man_page(client, 1, "lease this host's GPUs through its vaccel broker"))
    (out / "vaccel-brokerd.8").write_text(man_page(broker_parser(), 8, "the per-host GPU broker daemon"))
    (out / "vaccel.bash-completion").write_text(bash_completion(client))
    for name in ("vaccel.1", "vaccel-brokerd.8", "vaccel.bash-completion"):
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
