from bsr_cli.cli.main import main

main()
