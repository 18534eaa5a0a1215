"""One module per command group; each registers its commands on bsr_cli.cli.app.app."""
