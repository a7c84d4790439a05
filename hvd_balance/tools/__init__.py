"""Tools around the library: the ``hvd-balance`` command line, the emulation launcher, the
benchmarks and the simulation runner. No library module imports anything from here."""
