"""``python -m opencoti``: the same command line as the ``opencoti`` script and the .pyz."""

from opencoti.cli import main

if __name__ == "__main__":
    main()
