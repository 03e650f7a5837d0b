"""``python -m kasoku`` and the ``kasoku`` console command (``pyproject.toml``'s
``[project.scripts]``): ``kasoku.cli``'s program, with a Ctrl-C from this module's first line
on answered as one line, ``kasoku: interrupted``, and exit code 130 (128 + SIGINT), never a
traceback: importing the command line and torch takes seconds, and a person who changes
their mind then is not a failure. Nothing but the standard library is imported before the
guard is in place; only the interpreter's own start (before any of kasoku's code runs) is
outside it."""
import sys


def main() -> None:
    """The whole life of a ``kasoku`` process; ends it with the command's exit code."""
    try:
        from kasoku.cli import run_as_program  # inside the guard: it loads the commands
        run_as_program()
    except KeyboardInterrupt as exc:
        code = getattr(exc, "exit_code", 130)
        try:
            print("kasoku: interrupted", file=sys.stderr, flush=True)
        except KeyboardInterrupt:  # a second Ctrl-C while saying so: the code still stands
            pass
        sys.exit(code)


if __name__ == "__main__":
    main()
