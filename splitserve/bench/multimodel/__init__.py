"""The multimodel benchmark (``splitserve bench multimodel``): more models than fit in memory.

``scenario`` defines the parameters, starts the servers and measures every access sequence;
``report`` turns one run's numbers into its figures, report and plots.
"""
