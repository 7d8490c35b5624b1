import sys

from pagedllm_testing.emulator.running import main

sys.exit(main())
