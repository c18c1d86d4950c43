"""Settings, read from the environment with safe defaults.

Nothing is needed to start: with no variables set gpuplane runs embedded, on a SQLite
file under ``var/`` with tasks in-process. Production sets ``DATABASE_URL``,
``CELERY_BROKER_URL`` and ``DJANGO_SECRET_KEY``; secrets are never read from the repo.
"""

from __future__ import annotations

import math
import os
import secrets
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from gpuplane import settings_parsers

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("GPUPLANE_VAR_DIR", BASE_DIR / "var"))


def env_bool(name: str, default: bool) -> bool:
    """``name`` as true or false, read as the servers read theirs (``gpuplane.settings_parsers``)."""
    try:
        return settings_parsers.boolean(name, default)
    except settings_parsers.SettingError as exc:
        raise ImproperlyConfigured(str(exc)) from None


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """``name`` as an integer of at least ``minimum``, read as the servers read theirs."""
    try:
        return settings_parsers.positive_int(name, default, minimum)
    except settings_parsers.SettingError as exc:
        raise ImproperlyConfigured(str(exc)) from None


def env_float(name: str, default: float, minimum: float = 0.0, maximum: float = math.inf) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value) or value < minimum:
        raise ImproperlyConfigured(f"{name}={raw!r} must be a finite number of at least {minimum}")
    if value > maximum:
        raise ImproperlyConfigured(f"{name}={raw!r} must be at most {maximum}")
    return value


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name) or default
    if value not in choices:
        raise ImproperlyConfigured(f"{name}={value!r} must be one of {', '.join(choices)}")
    return value


def env_secret(name: str) -> str:
    """A secret from ``<name>`` or from the file ``<name>_FILE`` names, stripped of the
    trailing newline that ``kubectl create secret --from-file`` and editors leave: a
    ``GPUPLANE_METRICS_TOKEN`` ending in a newline made every scrape 401."""
    raw = os.environ.get(name, "")
    path = os.environ.get(f"{name}_FILE", "")
    if path:
        try:
            raw = Path(path).read_text()
        except OSError as exc:
            raise ImproperlyConfigured(f"{name}_FILE={path!r} cannot be read: {exc.strerror}") from None
    return raw.strip()


def env_log_level(name: str, default: str) -> str:
    value = (os.environ.get(name) or default).strip().upper()
    levels = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    if value not in levels:
        raise ImproperlyConfigured(f"{name}={os.environ.get(name)!r} must be one of {', '.join(levels)}")
    return value


def _secret_key() -> str:
    """DJANGO_SECRET_KEY, else a random key kept in var/ (embedded mode only).

    Surrounding whitespace is stripped, as for every secret here: a key pasted with a
    trailing newline into one pod's Secret and without it into another's would sign
    sessions and CSRF tokens the other pods reject. A key that is only whitespace is an
    error, not a reason to fall back to a random one."""
    raw = os.environ.get("DJANGO_SECRET_KEY", "")
    key = raw.strip()
    if key:
        return key
    if raw:
        raise ImproperlyConfigured("DJANGO_SECRET_KEY is only whitespace")
    path = VAR_DIR / "secret_key"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        key = secrets.token_urlsafe(50)
        path.write_text(key)
        path.chmod(0o600)
        return key


SECRET_KEY = _secret_key()
DEBUG = env_bool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = [h for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]").split(",") if h]
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("DJANGO_CSRF_TRUSTED_ORIGINS", "").split(",") if o]

INSTALLED_APPS = [
    "gpuplane.staff.apps.GpuplaneAdminConfig",  # django.contrib.admin with the staff pages
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "knox",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "binder",
    "usage",
    "webhooks",
    "gpuplane",  # project-level commands (demo); no models
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
]

#: Which server this process is: "api" (the admin and the tenant API, gunicorn) or
#: "webhook" (the VMI webhook alone on its own port, ``deploy/webhook_server.py``).
GPUPLANE_SERVE = env_choice("GPUPLANE_SERVE", "api", ("api", "webhook"))
ROOT_URLCONF = "gpuplane.webhook_urls" if GPUPLANE_SERVE == "webhook" else "gpuplane.urls"
if GPUPLANE_SERVE == "webhook":
    # The webhook port answers JSON to the kube-apiserver only (the webhook and its probes):
    # no sessions, users, messages, static files, forms or HTML to protect, and every
    # middleware is CPU on the path of every VMI the cluster creates (about 0.4 ms a call
    # of 1 ms). The security headers and the Host check stay.
    MIDDLEWARE = ["django.middleware.security.SecurityMiddleware", "django.middleware.common.CommonMiddleware"]
    # The admin's checks want its middleware, which this port does not serve.
    SILENCED_SYSTEM_CHECKS = ["admin.E408", "admin.E409", "admin.E410"]
WSGI_APPLICATION = "gpuplane.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
            # |iso, |age and |duration_ms on every staff page (gpuplane/staff/formatting.py)
            "builtins": ["gpuplane.staff.formatting"],
        },
    },
]

DATABASE_URL = os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'gpuplane.sqlite3'}"
DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=60)}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    # IMMEDIATE takes the write lock when a transaction starts, so a pass never fails
    # half way with "database is locked" on its first write.
    DATABASES["default"]["OPTIONS"] = {"timeout": 30, "transaction_mode": "IMMEDIATE"}
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    # Tests use a file, not shared-cache memory, so several connections (threads, the pass
    # lock's file lock) behave as they do in the embedded default.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test-gpuplane-{os.getpid()}.sqlite3")}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
#: ISO 8601 dates and times in the admin and the staff pages (the admin formats through the
#: locale, so a format module, not DATETIME_FORMAT here: gpuplane/formats/en/formats.py).
FORMAT_MODULE_PATH = ["gpuplane.formats"]
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
#: Collected static files. The container image collects them at build time into
#: GPUPLANE_STATIC_ROOT, outside /var/lib/gpuplane: that is a writable volume in a pod and
#: would hide whatever the image put there.
STATIC_ROOT = Path(os.environ.get("GPUPLANE_STATIC_ROOT") or VAR_DIR / "static")
if not STATIC_ROOT.is_dir():
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # whitenoise warns at start-up when it is missing
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True

# -- Celery: the binder queue ---------------------------------------------------------------
# One queue, "binder". Answer passes are published with priority 0 and full passes with
# priority 9. Kombu's Redis transport keeps one list per priority step ("binder",
# "binder:9") and pops them with one BRPOP in step order, so a worker always takes a
# waiting answer pass before a waiting full pass. With late acks and a prefetch of one,
# a worker holds no second message while a pass runs, so an answer pass waits at most
# for the pass in flight. (Several queues would not do: the worker rotates them.)
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL") or None
#: No broker: run tasks in-process (the embedded default).
CELERY_TASK_ALWAYS_EAGER = CELERY_BROKER_URL is None
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_DEFAULT_QUEUE = "binder"
CELERY_TASK_ROUTES = {"binder.*": {"queue": "binder"}}
#: Prefix of every Redis key of the queue and of the collapse flags: lets several installs
#: (or test runs) share one Redis.
GPUPLANE_BROKER_KEY_PREFIX = os.environ.get("GPUPLANE_BROKER_KEY_PREFIX", "")
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "priority_steps": [0, 9],
    "sep": ":",
    "queue_order_strategy": "priority",
    "visibility_timeout": 3600,
    "global_keyprefix": GPUPLANE_BROKER_KEY_PREFIX,
}
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
#: Periodic resync: a full pass every GPUPLANE_RESYNC_SECONDS (run ``celery beat``).
GPUPLANE_RESYNC_SECONDS = env_int("GPUPLANE_RESYNC_SECONDS", 30, minimum=1)
CELERY_BEAT_SCHEDULE = {
    "gpuplane-resync": {"task": "binder.resync", "schedule": float(GPUPLANE_RESYNC_SECONDS)},
}

# -- gpuplane --------------------------------------------------------------------
GPUPLANE_CLUSTER = env_choice("GPUPLANE_CLUSTER", "standalone", ("standalone", "kubernetes"))
GPUPLANE_ENABLED = env_bool("GPUPLANE_ENABLED", True)
#: The largest AdmissionReview body the webhook reads (bytes). A VMI is at most etcd's
#: 1.5 MiB object limit, and a review carries the object once for CREATE.
GPUPLANE_WEBHOOK_MAX_BYTES = env_int("GPUPLANE_WEBHOOK_MAX_BYTES", 3 * 1024 * 1024, minimum=1024)
#: Is the VMI webhook served at all? On in cluster mode (where the apiserver calls it on
#: the webhook server's own port), off in standalone mode unless turned on.
GPUPLANE_WEBHOOK_ENABLED = env_bool("GPUPLANE_WEBHOOK_ENABLED", GPUPLANE_CLUSTER == "kubernetes")
#: Who may call the webhook (only the kube-apiserver): "token" (the bearer token
#: the apiserver's AdmissionConfiguration kubeconfig sends, GPUPLANE_WEBHOOK_TOKEN_FILE),
#: "client-cert" (the webhook server verifies the apiserver's TLS client certificate
#: against GPUPLANE_WEBHOOK_CLIENT_CA before any byte reaches Django), or "none" (no check:
#: only behind a NetworkPolicy that admits the apiserver alone). Token by default in
#: cluster mode and whenever the webhook is on.
GPUPLANE_WEBHOOK_AUTH = env_choice(
    "GPUPLANE_WEBHOOK_AUTH", "token" if GPUPLANE_WEBHOOK_ENABLED else "none", ("token", "client-cert", "none")
)
GPUPLANE_WEBHOOK_CLIENT_CA = os.environ.get("GPUPLANE_WEBHOOK_CLIENT_CA", "")


def _webhook_token() -> str:
    """The webhook's bearer token, from GPUPLANE_WEBHOOK_TOKEN_FILE (a mounted Secret) or
    GPUPLANE_WEBHOOK_TOKEN; surrounding whitespace (the newline ``--from-file`` leaves) is
    not part of it."""
    path = os.environ.get("GPUPLANE_WEBHOOK_TOKEN_FILE", "")
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfigured(f"GPUPLANE_WEBHOOK_TOKEN_FILE={path!r}: {exc.strerror}") from None
    else:
        token = os.environ.get("GPUPLANE_WEBHOOK_TOKEN", "").strip()
    # Needed where the webhook is served: the webhook server, or the one server of standalone mode.
    serves = GPUPLANE_SERVE == "webhook" or GPUPLANE_CLUSTER == "standalone"
    if serves and GPUPLANE_WEBHOOK_ENABLED and GPUPLANE_WEBHOOK_AUTH == "token" and len(token) < 32:
        raise ImproperlyConfigured(
            "GPUPLANE_WEBHOOK_AUTH=token needs a token of at least 32 characters in GPUPLANE_WEBHOOK_TOKEN_FILE "
            "(or GPUPLANE_WEBHOOK_TOKEN); the kube-apiserver sends it (see docs/webhook.md, who may call), "
            "or set GPUPLANE_WEBHOOK_AUTH=client-cert / none"
        )
    return token


GPUPLANE_WEBHOOK_TOKEN = _webhook_token()
if GPUPLANE_WEBHOOK_AUTH == "client-cert" and GPUPLANE_SERVE == "webhook" and not GPUPLANE_WEBHOOK_CLIENT_CA:
    raise ImproperlyConfigured(
        "GPUPLANE_WEBHOOK_AUTH=client-cert needs GPUPLANE_WEBHOOK_CLIENT_CA: the CA that signed the "
        "kube-apiserver's client certificate"
    )
#: Cluster mode: the API server's URL, when neither in-cluster config nor a kubeconfig
#: should be used (``kubectl proxy`` at http://127.0.0.1:8001).
GPUPLANE_KUBE_HOST = os.environ.get("GPUPLANE_KUBE_HOST", "")
#: Cluster mode: ``sync_cluster`` lists every kind again this often (seconds), besides
#: watching, so a missed event is repaired within this time.
GPUPLANE_RELIST_SECONDS = env_int("GPUPLANE_RELIST_SECONDS", 300, minimum=5)
#: Cluster mode: how long one watch request lasts before it is renewed (seconds).
GPUPLANE_WATCH_SECONDS = env_int("GPUPLANE_WATCH_SECONDS", 60, minimum=1)
#: How long the VMI webhook waits for the binder's answer (seconds, fractions allowed;
#: keep it below the webhook's timeoutSeconds, 10 by default).
GPUPLANE_BIND_WAIT_SECONDS = env_float("GPUPLANE_BIND_WAIT_SECONDS", 8.0, minimum=0.1)
#: The most calls one web process lets wait for the binder at once (0: no limit). Each
#: holds a server thread until answered; past the limit a new order is denied "try again"
#: at once, writing nothing, so a flood of new orders leaves threads for the rest.
GPUPLANE_WEBHOOK_MAX_WAITING = env_int("GPUPLANE_WEBHOOK_MAX_WAITING", 0)
GPUPLANE_NODE_GRACE_SECONDS = env_int("GPUPLANE_NODE_GRACE_SECONDS", 300)
#: Making room: at most this many stopped VMs' sets move in one full pass (0: none move).
GPUPLANE_MOVES_PER_PASS = env_int("GPUPLANE_MOVES_PER_PASS", 16)
#: A set the webhook admitted a VMI to less than this long ago does not move to make room (and
#: an over-booked node keeps it for the first 10 s of that: its VMI may not be mirrored yet).
GPUPLANE_MOVE_GRACE_SECONDS = env_int("GPUPLANE_MOVE_GRACE_SECONDS", 120)
#: Billing rates per class (or raw resource) key per GPU-hour for the usage chart's ranked
#: table and billing CSV, e.g. "h100=2.50,a10=0.60"; the page's "rates" field overrides it.
GPUPLANE_BILLING_RATES = os.environ.get("GPUPLANE_BILLING_RATES", "")
#: A queued full pass waits behind answer passes at most this long (once it is due).
GPUPLANE_FULL_PASS_MAX_DELAY_SECONDS = env_float("GPUPLANE_FULL_PASS_MAX_DELAY_SECONDS", 5.0)
#: An answer pass that placed a set asks for the full pass (usage records, class and budget
#: status) this many seconds later, not at once, so that the answer passes after it do not
#: wait behind it; requests meanwhile fold into it. 0: at once. Records are dated by the
#: devices' ``since`` either way.
GPUPLANE_FULL_PASS_AFTER_ANSWER_SECONDS = env_float("GPUPLANE_FULL_PASS_AFTER_ANSWER_SECONDS", 1.0, maximum=60.0)
#: A change the sync mirrors asks for the full pass this many seconds later, not at once;
#: changes meanwhile fold into it. A burst of creates (a set's devices, arriving one by one;
#: a thousand orders) is then placed by a few passes, each seeing whole sets, instead of
#: one pass per event racing the sync. Answer passes (a VMI starting) never wait for it.
#: 0: at once.
GPUPLANE_FULL_PASS_AFTER_EVENT_SECONDS = env_float("GPUPLANE_FULL_PASS_AFTER_EVENT_SECONDS", 0.5, maximum=60.0)
#: Every GPUPLANE_VERIFY_SECONDS a pass rebuilds its view from scratch,
#: runs the engine both ways and compares (0: every pass; the tests use it).
GPUPLANE_VERIFY_SECONDS = env_int("GPUPLANE_VERIFY_SECONDS", 600)
#: A pass worker not seen for this long no longer holds back the pruning of the change
#: feed; when it comes back it reads everything again (binder.models.FeedReader).
GPUPLANE_FEED_RETENTION_SECONDS = env_int("GPUPLANE_FEED_RETENTION_SECONDS", 900, minimum=1)
#: Pass workers save their in-memory state to the database after each verification and
#: at a clean shutdown, and a starting worker loads the newest one and replays the change
#: feed after it instead of reading every row (binder.runtime.checkpoint). "false": every
#: start reads everything.
GPUPLANE_CHECKPOINTS = env_bool("GPUPLANE_CHECKPOINTS", True)
#: Each web process builds its read model of the mirror in a thread as it starts, so
#: ``/readyz`` turns 200 before the first call (off: built by the first call that needs it).
GPUPLANE_READ_MODEL_AT_START = env_bool("GPUPLANE_READ_MODEL_AT_START", True)
GPUPLANE_DEFAULT_BUDGET = env_choice("GPUPLANE_DEFAULT_BUDGET", "unlimited", ("unlimited", "deny"))
#: Fault injection for the worker integration tests only: sleep this long inside every
#: pass, holding the pass lock, between reading and writing. Never set it in production.
GPUPLANE_FAULT_PASS_DELAY_SECONDS = env_float("GPUPLANE_FAULT_PASS_DELAY_SECONDS", 0.0)
#: Every change of a mirrored object queues a full pass (turned off in unit tests that
#: drive passes by hand).
GPUPLANE_AUTO_PASS = env_bool("GPUPLANE_AUTO_PASS", True)
#: If set, GET /metrics needs ``Authorization: Bearer <token>`` (read from the variable or
#: the file ``GPUPLANE_METRICS_TOKEN_FILE`` names, stripped).
GPUPLANE_METRICS_TOKEN = env_secret("GPUPLANE_METRICS_TOKEN")
#: Without a token, /metrics is open only in standalone mode: in cluster mode the pods are
#: reachable from every tenant's namespace, so a scrape needs the token unless this is
#: set to true on purpose.
GPUPLANE_METRICS_OPEN = env_bool("GPUPLANE_METRICS_OPEN", GPUPLANE_CLUSTER == "standalone")

# -- HTTPS: HSTS, Secure cookies, CSP --------------------------------------------------------
#: The pods serve HTTPS when GPUPLANE_TLS_CERT_FILE is set (deploy/gunicorn.conf.py);
#: GPUPLANE_HTTPS=true says so behind a TLS-terminating proxy. Then browsers are told to
#: use HTTPS only (HSTS) and to send the session and CSRF cookies only over it.
GPUPLANE_HTTPS = env_bool("GPUPLANE_HTTPS", bool(os.environ.get("GPUPLANE_TLS_CERT_FILE")))
if GPUPLANE_HTTPS:
    SECURE_HSTS_SECONDS = env_int("GPUPLANE_HSTS_SECONDS", 365 * 24 * 3600, minimum=1)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
SECURE_CONTENT_TYPE_NOSNIFF = True
#: Content-Security-Policy on every response (Django's middleware): scripts only from the
#: site's own static files (the board's script is one; no inline script), no plugins, no
#: framing. Inline style attributes stay allowed (bar widths, colour swatches): styles
#: run no code. The API docs pages (Swagger UI, Redoc) start with an inline script and
#: get their own policy (gpuplane.urls).
SECURE_CSP = {
    "default-src": ["'self'"],
    "script-src": ["'self'"],
    "style-src": ["'self'", "'unsafe-inline'"],
    "img-src": ["'self'", "data:"],
    "object-src": ["'none'"],
    "base-uri": ["'self'"],
    "frame-ancestors": ["'none'"],
    "form-action": ["'self'"],
}

REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # Token first: a request without credentials gets 401 with WWW-Authenticate: Token.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "usage.api.auth.TokenAuthentication",  # knox's, with a word for "Bearer"
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "DATETIME_FORMAT": "iso-8601",
}
#: API tokens (django-rest-knox): only a SHA-512 digest is stored, a user may hold several,
#: and each expires (``manage.py issue_token --days``; 0 = never). ``gpp_`` marks them for
#: secret scanners.
REST_KNOX = {
    "TOKEN_TTL": None,
    "TOKEN_PREFIX": "gpp_",
    "AUTH_HEADER_PREFIX": "Token",
    "AUTO_REFRESH": False,
}
#: Default token lifetime for ``manage.py issue_token`` (days; 0: never expires).
GPUPLANE_TOKEN_DAYS = env_int("GPUPLANE_TOKEN_DAYS", 90)
#: The usage API's default window when ``from`` is not given: this many days before ``to``.
GPUPLANE_USAGE_DEFAULT_DAYS = env_int("GPUPLANE_USAGE_DEFAULT_DAYS", 30, minimum=1)
SPECTACULAR_SETTINGS = {
    "TITLE": "gpuplane API",
    "DESCRIPTION": (
        "GPU placement, budgets and usage for KubeVirt VMs. Authenticate with "
        "`Authorization: Token <token>` (from `manage.py issue_token`); tenants see only the "
        "namespaces granted to them, and another namespace answers 404."
    ),
    "VERSION": "0.1.0",
    # Swagger UI and Redoc from the drf-spectacular-sidecar package: no CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "SERVE_INCLUDE_SCHEMA": False,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "gpuplane.schema.no_nul_in_text_parameters",
    ],  # the schema endpoint documents the API, not itself
    "APPEND_COMPONENTS": {
        "securitySchemes": {
            "tokenAuth": {
                "type": "apiKey",
                "in": "header",
                "name": "Authorization",
                "description": "`Token <token>` as printed by `manage.py issue_token`",
            }
        }
    },
    "SECURITY": [{"tokenAuth": []}],
    "AUTHENTICATION_WHITELIST": ["knox.auth.TokenAuthentication"],
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_log_level("GPUPLANE_LOG_LEVEL", "INFO")},
}
