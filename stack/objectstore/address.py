"""Where the stack's object store listens: loopback only, since it does not authenticate requests."""

HOST = "127.0.0.1"
