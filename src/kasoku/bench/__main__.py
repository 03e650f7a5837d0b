"""``python -m kasoku.bench WORKLOAD [options]``: ``kasoku bench`` without the main CLI."""
import argparse
import sys

from kasoku.bench.cli_args import add_bench_parser, cmd_bench
from kasoku.errors import ConfigError, DataError


def main(argv=None) -> int:
    from kasoku.perf.queues import request_queues
    request_queues()  # as kasoku's main command line does
    parser = argparse.ArgumentParser(prog="kasoku")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return cmd_bench(args)
    except (ConfigError, DataError) as exc:
        print(f"kasoku: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
