from dfserve.cli import main

main()
