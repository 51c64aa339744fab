from kvarn.cli import main

raise SystemExit(main())
