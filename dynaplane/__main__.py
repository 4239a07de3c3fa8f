from dynaplane.cli import main

raise SystemExit(main())
