"""``kasoku list``: the registered workloads with their recipes, and the loaders."""
from __future__ import annotations

from kasoku.commands.table import print_table
from kasoku.data.registry import list_loaders, loader_kind
from kasoku.workloads import create_workload, list_workloads


def add_parser(sub) -> None:
    p = sub.add_parser("list", help="list the registered workloads (with their recipes) and "
                       "loaders")
    p.set_defaults(handler=run)


def run(args) -> int:
    rows = []
    for name in list_workloads():
        wl = create_workload(name)
        r = wl.recipe
        rows.append([name, wl.description, r.optimizer, f"{r.lr:g}", str(r.batch_size),
                     f"{r.epochs:g}"])
    print_table(["workload", "what", "optimizer", "lr", "batch", "epochs"], rows,
                title="workloads (kasoku train|bench NAME; FILE.py:NAME for your own)")
    print()
    rows = [[name + ("[:N]" if loader_kind(name).count else ""), loader_kind(name).help]
            for name in list_loaders()]
    print_table(["loader", "what"], rows, title="loaders (--loader KIND[:N])")
    return 0
