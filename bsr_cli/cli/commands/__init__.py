"""One module per command group: plain command functions (and their sub-groups), registered explicitly by
bsr_cli.cli.app.register_commands; none imports the app."""
