"""Format modules (``FORMAT_MODULE_PATH``): the one time format of every staff page."""
