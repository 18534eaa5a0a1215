"""One module per command group: plain command functions (and their sub-groups), each named in the table of
bsr_cli.cli.app.COMMANDS, which imports a module only when one of its commands runs or its help is asked; none
imports the app."""
