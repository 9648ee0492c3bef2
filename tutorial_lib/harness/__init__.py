"""What every layer may use: self-checks (``checks``), the papermill runner for the lessons
(``notebooks``, ``python -m tutorial_lib.harness.notebooks``), the rendered lessons committed for
reading (``render``, ``python -m tutorial_lib.harness.render``), progress bars for long work
(``progress``), and all timing and benchmark plumbing (``bench``; ``bench_report``, whose
``python -m tutorial_lib.harness.bench_report`` regenerates the README table)."""
