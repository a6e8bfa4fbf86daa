from april_server.cli import main

main()
