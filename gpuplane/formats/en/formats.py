"""English formats with ISO 8601 dates and times (the admin's columns, forms and widgets).

Django's admin prints dates through the locale's formats (``USE_L10N`` is always on), so
``DATETIME_FORMAT`` in settings alone would not reach it; a format module does. Seconds
and the zone's offset are part of every time: "12:00" on one page and "12:00:41" on
another must never look like different moments.
"""

DATETIME_FORMAT = r"Y-m-d\TH:i:sO"
SHORT_DATETIME_FORMAT = DATETIME_FORMAT
DATE_FORMAT = "Y-m-d"
SHORT_DATE_FORMAT = DATE_FORMAT
TIME_FORMAT = "H:i:s"
MONTH_DAY_FORMAT = "m-d"
YEAR_MONTH_FORMAT = "Y-m"
DATE_INPUT_FORMATS = ["%Y-%m-%d"]
TIME_INPUT_FORMATS = ["%H:%M:%S", "%H:%M"]
DATETIME_INPUT_FORMATS = ["%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M"]
FIRST_DAY_OF_WEEK = 1
