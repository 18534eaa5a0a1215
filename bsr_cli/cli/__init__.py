"""The `bsr` command line: thin commands over the core and the client, one output layer, one error boundary."""
