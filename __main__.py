from ckptfs.tools.cli import main

raise SystemExit(main())
