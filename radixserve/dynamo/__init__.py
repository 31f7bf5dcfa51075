"""radixserve as an NVIDIA Dynamo backend: `python -m radixserve.dynamo --model DIR [radixserve flags]`.

The worker process stands where the HTTP process stands in the server (as `Engine` does): it starts radixserve's
scheduler and workers through the launcher and talks to the scheduler over the same sockets and messages
(radixserve/protocol.py). Dynamo's frontend tokenizes and detokenizes; this worker takes token ids in and gives token
ids out (engine.py), maps Dynamo's request onto SamplingParams (requests.py), and relays the radix tree's KV block
events to Dynamo's KV router (kv_publisher.py; the events themselves come from scheduler_service/kv_events.py).

Needs the `dynamo` extra (README "Scaling out"); nothing else in radixserve imports this package.
"""
