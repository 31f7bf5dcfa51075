"""python -m radixserve.dynamo --model DIR [radixserve flags]: one radixserve engine as a Dynamo worker.

Dynamo's Worker owns the process from here: it builds the distributed runtime, calls the engine's start(), registers
the model, serves requests, and on SIGINT/SIGTERM unregisters, drains and calls cleanup(), which stops radixserve's
processes. Exit code 1 when the engine failed (a child died or hung) rather than being stopped."""

import sys

from dynamo.common.backend.run import run

from radixserve.dynamo.engine import RadixserveEngine


def main(argv: list[str] | None = None) -> int:
    engines = []

    async def make(args):
        engine, config = await RadixserveEngine.from_args(args)
        engines.append(engine)
        return engine, config

    run(RadixserveEngine, argv, engine_factory=make)
    return 1 if engines and engines[0].failed else 0


if __name__ == "__main__":
    sys.exit(main())
