from relaunch.cli import main

main()
