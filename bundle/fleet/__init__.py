"""A fleet's evidence on NATS JetStream: the names, models and message encoding that the agent's
publisher (agent/daemon/fleet.py) and the `evidence fleet` reader (bundle/commands/fleet.py) share.

Pure: nothing here imports nats-py or does I/O (bundle/fleet/client.py is the reader's I/O).
"""
