"""The process runtime: what starts, links and supervises the engine's processes.

- `launcher.py`: `Launcher` starts every child (workers, scheduler or DP controller, tokenizer process), hands each
  its 0600 config file, waits for ready / failed, and watches heartbeats for deaths and hangs.
- `process_util.py`: what every child does first (`run_child`: read the config, die with the parent, report ready,
  start heartbeats).
- `heartbeat.py`: the child's side of hang detection (`progress`, `start_heartbeat`).
- `preflight.py`: operator mistakes caught before anything starts (`check_before_launch`).
- `ipc.py`: the ZeroMQ endpoints between the processes and typed send / receive of protocol Structs (`Channel`).
- `node_link.py` + `node_keys.py`: a multi-node server's links between launchers and their CURVE keys.
- `distributed.py`: the tensor-parallel process group and its collectives.
- `data_parallel.py`: where data-parallel replica i's processes live (`--dp-size`).
"""
