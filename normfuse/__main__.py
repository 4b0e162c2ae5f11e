from normfuse.cli import main

raise SystemExit(main())
