from pyrecover.cli import main

main()
