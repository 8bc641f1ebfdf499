"""The arithmetic behind Kiln's benchmark figures, in the package so the tests can hold it to account: budgets,
bytes per token, bounds, forecasts and accuracy measures. The entry points that time things and write results
are bench/ (run as `python -m bench.NAME`); nothing here times a run or imports bench."""
