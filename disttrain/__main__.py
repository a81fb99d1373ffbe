"""python -m disttrain: the `disttrain` command (cli.py), where its script is not on the PATH."""

from disttrain import cli

if __name__ == '__main__':
  cli.main()
