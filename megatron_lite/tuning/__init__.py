"""The tuning recipe as code: calibrate the machine and the model, plan layouts, sweep short runs, report."""
