"""The link to the outside: MQTT connection and commands, topics, the store-and-forward outbox, health, discovery, monitor, push.
"""
