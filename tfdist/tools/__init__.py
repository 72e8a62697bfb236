"""The tools around the library: the `tfdist` command (cli), configs (config), the job runner
(runner), built-in models (models), benchmark suites (bench), the emulated multi-host cluster
(emulated) and the launchers (launch).

The library (everything else under `tfdist/`) never imports this package; these modules use the
library like any user would.
"""
