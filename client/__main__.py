import sys

from client.cli import main

# Guarded: --processes spawns workers, and a spawned child may import the main module again.
if __name__ == "__main__":
    sys.exit(main())
