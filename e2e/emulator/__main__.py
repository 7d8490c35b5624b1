import sys

from e2e.emulator.running import main

sys.exit(main())
