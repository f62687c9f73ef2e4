"""Router overhead on loopback: N concurrent streams through ``twin router`` vs straight to ``twin emulate``.

Needs the ``router`` extra. ``python benchmarks/router_overhead.py --replicas 4 --streams 16,64 --duration-s 15``;
see ``twin/router/loadtest.py`` for the options and ``docs/router.md`` for measured numbers.
"""

from twin.router.loadtest import parse_args, run

if __name__ == "__main__":
    run(parse_args())
