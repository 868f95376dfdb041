import sys

from dejavu_cli.main import main

sys.exit(main())
