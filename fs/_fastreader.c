/* ckptfs.fs._fastreader: the request thread's compiled reader.

   Why compiled: on a VM whose caches the host takes between bursts, the
   request thread's Python for one read-only open ran about 250 us cold
   (15 us warm), and torch.load(mmap=True) sends that OPEN and an IOCTL
   (Python's isatty) inside the window in which a replace of the path tears
   the load (issue 13, docs/PERFORMANCE.md). This reader waits for and reads
   each request, answers the IOCTL (ENOTTY, as Session._stateless does) and a
   read-only OPEN for which the filesystem issued an *open ticket*, and hands
   everything else back to Python. A load that comes after a second's pause
   (the kernel's entry and attribute timeouts) also sends a GETATTR of each
   directory on its path and a LOOKUP of each name, which Python answered
   after a stat of the store, about 1 ms in all cold: the same kind of
   ticket answers those too (*attr* and *entry* tickets), after the same stat
   made here, when it finds what the filesystem's last look found.

   Who owns what: the filesystem (Python) owns every file's state. A ticket
   says "a read-only open of this inode gets a handle with these reply
   flags", issued by the request thread's Python under the state lock, and
   valid only while the ticket epoch is unchanged and until its deadline
   (the manifest check it rests on). The loop bumps the epoch each time it
   takes the state lock back (it may change anything then), so a ticket
   never outlives a state change. An open answered here takes the state lock
   without waiting (as every off-loop answer does), checks the ticket under
   it, and queues the handle it gave out; whoever takes the lock next adopts
   the queued handles (drain) before it reads any state. A LOOKUP answered
   here adds a kernel reference to the inode, and a check made here is one
   the filesystem must know of: both are queued the same way (drain_seen). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#define IN_HEADER 40
#define OUT_HEADER 16
#define OP_LOOKUP 1
#define OP_GETATTR 3
#define OP_OPEN 14
#define ATTR_OUT 104  /* struct fuse_attr_out */
#define ENTRY_OUT 128 /* struct fuse_entry_out */
#define NAME_MAX_LEN 255
#define OP_IOCTL 39
#define TICKETS 256 /* direct-mapped by inode number: a collision only evicts */
#define FIRST_FH (1ULL << 62) /* disjoint from the filesystem's own handles */

/* What serve() returns besides a request's size. */
#define TIMED_OUT 0
#define WOKEN (-1)
#define ANSWERED (-2)
#define NOTHING (-3)

/* A check of our own (a local store only): a stat of ``path`` under the
   store's root must find the same ``identity`` as the filesystem's last
   look, and the same kind (a manifest is a regular file): dev, ino, size,
   mtime_ns, ctime_ns, and for a directory every other field its attributes
   show (atime_ns, nlink, mode, uid, gid: two changes within one tick of the
   kernel's coarse clock leave its times as they were). */
#define FILE_IDENTITY 5
#define DIR_IDENTITY 10
typedef struct {
    char *path; /* NULL: no check here */
    int64_t identity[DIR_IDENTITY];
    int directory;
} Check;

typedef struct {
    uint64_t ino;
    uint64_t epoch;
    double deadline; /* CLOCK_MONOTONIC seconds, as time.monotonic() */
    uint32_t flags;  /* the next OPEN reply's open_flags */
    uint32_t later;  /* the open_flags after that one (its open sets what the kernel keeps) */
    /* Past the deadline: the manifest's check, and how long a check lasts
       (fuse.open_recheck). */
    Check check;
    double recheck;
} Ticket;

/* A GETATTR of ``ino`` is answered with ``reply`` until the deadline, and
   after it once a check finds the same entry (for ``recheck`` seconds more). */
typedef struct {
    uint64_t ino;
    uint64_t epoch;
    double deadline;
    double recheck;
    Check check;
    unsigned char reply[ATTR_OUT];
} AttrTicket;

/* A LOOKUP of ``name`` in ``parent`` is answered with ``reply`` (the entry of
   ``child``) whenever a check finds the same entry: a lookup is a look at
   the store each time (the kernel sends one once its entry timeout ran out). */
typedef struct {
    uint64_t parent;
    uint64_t child;
    uint64_t epoch;
    size_t name_len;
    char name[NAME_MAX_LEN + 1];
    Check check;
    unsigned char reply[ENTRY_OUT];
} EntryTicket;

typedef struct {
    uint64_t fh, ino;
    uint32_t uid, gid, pid;
    double checked_at; /* when its own check began (time.monotonic()); 0: none */
} Opened;

/* What the filesystem must learn of a LOOKUP or GETATTR answered here. */
typedef struct {
    uint64_t ino;
    int lookup;        /* a LOOKUP: the kernel holds one more reference */
    double checked_at; /* when a check of ours began that found the last look's entry; 0: none */
} Seen;

typedef struct {
    PyObject_HEAD
    int fd;
    int wake_fd;
    PyObject *lock;  /* the session's state lock */
    PyObject *holds; /* its _LoopHoldsState: loop_waits */
    int store_fd;    /* the backing store's root, for checks of our own; -1: none */
    uint64_t epoch;
    uint64_t next_fh;
    Ticket tickets[TICKETS];
    AttrTicket attrs[TICKETS];
    EntryTicket entries[TICKETS]; /* direct-mapped by (parent, name) */
    Opened *opened;
    Py_ssize_t n_opened, cap_opened;
    Seen *seen;
    Py_ssize_t n_seen, cap_seen;
    unsigned long long opens, ioctls, getattrs, lookups, write_errors, checks;
} Reader;

static PyObject *str_loop_waits, *str_acquire, *str_release;

static double now_monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int Reader_init(Reader *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"fd", "wake_fd", "lock", "holds", NULL};
    PyObject *lock, *holds;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiOO", kwlist, &self->fd, &self->wake_fd,
                                     &lock, &holds))
        return -1;
    Py_XSETREF(self->lock, Py_NewRef(lock));
    Py_XSETREF(self->holds, Py_NewRef(holds));
    self->epoch = 1; /* tickets are zeroed: epoch 0 is never current */
    self->next_fh = FIRST_FH;
    self->store_fd = -1;
    return 0;
}

static void Reader_dealloc(Reader *self) {
    for (int i = 0; i < TICKETS; i++) {
        PyMem_Free(self->tickets[i].check.path);
        PyMem_Free(self->attrs[i].check.path);
        PyMem_Free(self->entries[i].check.path);
    }
    Py_XDECREF(self->lock);
    Py_XDECREF(self->holds);
    PyMem_Free(self->opened);
    PyMem_Free(self->seen);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The state lock, taken without waiting, unless the loop waits for it
   (_LoopHoldsState.try_take). 1: taken; 0: not; -1: a Python error. */
static int take_state(Reader *self) {
    PyObject *waits = PyObject_GetAttr(self->holds, str_loop_waits);
    if (waits == NULL)
        return -1;
    int busy = PyObject_IsTrue(waits);
    Py_DECREF(waits);
    if (busy != 0)
        return busy < 0 ? -1 : 0;
    PyObject *got = PyObject_CallMethodOneArg(self->lock, str_acquire, Py_False);
    if (got == NULL)
        return -1;
    int taken = PyObject_IsTrue(got);
    Py_DECREF(got);
    return taken;
}

static int let_go_state(Reader *self) {
    PyObject *r = PyObject_CallMethodNoArgs(self->lock, str_release);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static int queue_opened(Reader *self, const Opened *o) {
    if (self->n_opened == self->cap_opened) {
        Py_ssize_t cap = self->cap_opened ? self->cap_opened * 2 : 16;
        Opened *grown = PyMem_Realloc(self->opened, (size_t)cap * sizeof(Opened));
        if (grown == NULL)
            return -1;
        self->opened = grown;
        self->cap_opened = cap;
    }
    self->opened[self->n_opened++] = *o;
    return 0;
}

static int queue_seen(Reader *self, uint64_t ino, int lookup, double checked_at) {
    if (self->n_seen == self->cap_seen) {
        Py_ssize_t cap = self->cap_seen ? self->cap_seen * 2 : 16;
        Seen *grown = PyMem_Realloc(self->seen, (size_t)cap * sizeof(Seen));
        if (grown == NULL)
            return -1;
        self->seen = grown;
        self->cap_seen = cap;
    }
    Seen s = {ino, lookup, checked_at};
    self->seen[self->n_seen++] = s;
    return 0;
}

/* The reply, written with the GIL let go; ENOENT (the caller was
   interrupted) and ENODEV (unmounted) are not errors here, as in
   Session._write; anything else is counted. */
static void write_reply(Reader *self, const void *reply, size_t size) {
    ssize_t w;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    w = write(self->fd, reply, size);
    if (w < 0)
        err = errno;
    Py_END_ALLOW_THREADS
    if (w < 0 && err != ENOENT && err != ENODEV)
        self->write_errors++;
}

static void yield_cpu(void) {
    /* As the Python thread does after its own answers: the caller, woken by
       the reply, often lands on this CPU; let it run first. */
    Py_BEGIN_ALLOW_THREADS
    sched_yield();
    Py_END_ALLOW_THREADS
}

/* A check of our own (close-to-open, or a lookup's look at the store):
   whether ``c``'s path still holds the very entry the filesystem's last
   look found. One stat of a local store, with the GIL let go; any doubt (an
   error, another entry) leaves the request to Python's own check. */
static int same_check(Reader *self, const Check *c) {
    char path[PATH_MAX];
    int64_t want[DIR_IDENTITY];
    int directory = c->directory;
    size_t len = strlen(c->path);
    if (len >= sizeof path)
        return 0;
    memcpy(path, c->path, len + 1);
    memcpy(want, c->identity, sizeof want);
    struct stat st;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = fstatat(self->store_fd, path, &st, AT_SYMLINK_NOFOLLOW);
    Py_END_ALLOW_THREADS
    self->checks++;
    if (r != 0 || !(directory ? S_ISDIR(st.st_mode) : S_ISREG(st.st_mode)))
        return 0;
    int64_t got[DIR_IDENTITY] = {
        (int64_t)st.st_dev,
        (int64_t)st.st_ino,
        (int64_t)st.st_size,
        (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec,
        (int64_t)st.st_ctim.tv_sec * 1000000000 + st.st_ctim.tv_nsec,
        (int64_t)st.st_atim.tv_sec * 1000000000 + st.st_atim.tv_nsec,
        (int64_t)st.st_nlink,
        (int64_t)st.st_mode,
        (int64_t)st.st_uid,
        (int64_t)st.st_gid,
    };
    return memcmp(got, want, (directory ? DIR_IDENTITY : FILE_IDENTITY) * sizeof(int64_t)) == 0;
}

/* A Python error here must not cost the request its answer: it is reported
   (as an unraisable exception, which the daemon logs) and the open goes to
   Python's own path. */
static int declined_on_error(void) {
    PyErr_WriteUnraisable(NULL);
    return 0;
}

/* Whether a ticket valid until ``deadline`` may answer now: before it, or
   after a check of ours (``check``) that finds the last look's entry;
   ``checked_at`` then says when that check began (else 0). */
static int still_good(Reader *self, double deadline, const Check *check, double *checked_at) {
    *checked_at = 0.0;
    if (now_monotonic() < deadline)
        return 1;
    if (check->path == NULL || self->store_fd < 0)
        return 0;
    *checked_at = now_monotonic(); /* as Python's check: when the read began */
    return same_check(self, check);
}

/* The state lock, taken without waiting: 1 taken, 0 not (a Python error is
   reported, and the request goes to Python). */
static int lock_state(Reader *self) {
    int taken = take_state(self);
    return taken < 0 ? declined_on_error() : taken;
}

/* Declines with the state lock taken: let go of it. */
static int decline_locked(Reader *self) {
    if (PyErr_Occurred())
        PyErr_WriteUnraisable(NULL);
    return let_go_state(self) < 0 ? declined_on_error() : 0;
}

/* A read-only OPEN of a ticketed inode: 1 answered, 0 Python's to answer. */
static int try_open(Reader *self, const unsigned char *buf, ssize_t n, uint64_t unique,
                    uint64_t ino, uint32_t uid, uint32_t gid, uint32_t pid) {
    if (n < IN_HEADER + 8)
        return 0;
    uint32_t flags;
    memcpy(&flags, buf + IN_HEADER, sizeof flags);
    if ((flags & O_ACCMODE) != O_RDONLY || (flags & O_TRUNC))
        return 0;
    Ticket *t = &self->tickets[ino % TICKETS];
    if (t->ino != ino || t->epoch != self->epoch)
        return 0;
    double checked_at;
    if (!still_good(self, t->deadline, &t->check, &checked_at) || !lock_state(self))
        return 0;
    /* The loop may have taken the lock back (and bumped the epoch) since. */
    Opened o = {self->next_fh, ino, uid, gid, pid, checked_at};
    int valid = t->ino == ino && t->epoch == self->epoch &&
                (checked_at > 0.0 || now_monotonic() < t->deadline);
    if (!valid || queue_opened(self, &o) < 0)
        return decline_locked(self);
    self->next_fh++;
    struct {
        uint32_t len;
        int32_t error;
        uint64_t unique;
        uint64_t fh;
        uint32_t open_flags;
        int32_t backing_id;
    } reply = {sizeof reply, 0, unique, o.fh, t->flags, 0};
    t->flags = t->later;
    if (checked_at > 0.0)
        t->deadline = checked_at + t->recheck; /* as the filesystem's open_ticket would say */
    write_reply(self, &reply, sizeof reply);
    self->opens++;
    if (let_go_state(self) < 0) /* not ours after all: nothing to undo */
        PyErr_WriteUnraisable(NULL);
    return 1;
}

/* The reply to ``unique``: ``body`` after a success header. */
static void write_body(Reader *self, uint64_t unique, const unsigned char *body, size_t len) {
    unsigned char out[OUT_HEADER + ENTRY_OUT];
    uint32_t total = (uint32_t)(OUT_HEADER + len);
    int32_t error = 0;
    memcpy(out, &total, 4);
    memcpy(out + 4, &error, 4);
    memcpy(out + 8, &unique, 8);
    memcpy(out + OUT_HEADER, body, len);
    write_reply(self, out, total);
}

/* A GETATTR of an inode with an attr ticket: 1 answered, 0 Python's to answer. */
static int try_getattr(Reader *self, uint64_t unique, uint64_t ino) {
    AttrTicket *t = &self->attrs[ino % TICKETS];
    if (t->ino != ino || t->epoch != self->epoch)
        return 0;
    double checked_at;
    if (!still_good(self, t->deadline, &t->check, &checked_at) || !lock_state(self))
        return 0;
    int valid = t->ino == ino && t->epoch == self->epoch &&
                (checked_at > 0.0 || now_monotonic() < t->deadline);
    if (!valid || (checked_at > 0.0 && queue_seen(self, ino, 0, checked_at) < 0))
        return decline_locked(self);
    if (checked_at > 0.0)
        t->deadline = checked_at + t->recheck;
    write_body(self, unique, t->reply, ATTR_OUT);
    self->getattrs++;
    if (let_go_state(self) < 0)
        PyErr_WriteUnraisable(NULL);
    return 1;
}

static size_t entry_slot(uint64_t parent, const char *name, size_t len) {
    uint64_t h = 1469598103934665603ULL ^ parent; /* FNV-1a over the name */
    for (size_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)name[i]) * 1099511628211ULL;
    return (size_t)(h % TICKETS);
}

/* A LOOKUP of a name with an entry ticket: 1 answered, 0 Python's to answer. */
static int try_lookup(Reader *self, const unsigned char *buf, ssize_t n, uint64_t unique,
                      uint64_t parent) {
    const char *name = (const char *)buf + IN_HEADER;
    size_t avail = (size_t)(n - IN_HEADER);
    size_t len = strnlen(name, avail);
    if (len == 0 || len == avail || len > NAME_MAX_LEN)
        return 0;
    EntryTicket *e = &self->entries[entry_slot(parent, name, len)];
    if (e->epoch != self->epoch || e->parent != parent || e->name_len != len ||
        memcmp(e->name, name, len) != 0 || e->check.path == NULL || self->store_fd < 0)
        return 0;
    double checked_at = now_monotonic();
    if (!same_check(self, &e->check) || !lock_state(self))
        return 0;
    if (e->epoch != self->epoch || queue_seen(self, e->child, 1, checked_at) < 0)
        return decline_locked(self);
    write_body(self, unique, e->reply, ENTRY_OUT);
    self->lookups++;
    if (let_go_state(self) < 0)
        PyErr_WriteUnraisable(NULL);
    return 1;
}

static PyObject *Reader_serve(Reader *self, PyObject *args) {
    PyObject *bufobj;
    int timeout_ms;
    if (!PyArg_ParseTuple(args, "Oi", &bufobj, &timeout_ms))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(bufobj, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    long result;
    int answered = 0;
    for (;;) {
        ssize_t n;
        int err = 0, polled = 0, woken = 0, poll_err = 0;
        Py_BEGIN_ALLOW_THREADS
        /* Read before waiting: a caller's next request is often there. */
        n = read(self->fd, view.buf, (size_t)view.len);
        err = n < 0 ? errno : 0;
        if (n < 0 && err == EAGAIN && !answered) {
            struct pollfd p[2] = {{self->fd, POLLIN, 0}, {self->wake_fd, POLLIN, 0}};
            int r = poll(p, 2, timeout_ms);
            polled = 1;
            if (r > 0 && (p[1].revents & POLLIN))
                woken = 1;
            else if (r > 0) {
                n = read(self->fd, view.buf, (size_t)view.len);
                err = n < 0 ? errno : 0;
            } else if (r < 0 && errno != EINTR) {
                poll_err = errno;
            }
        }
        Py_END_ALLOW_THREADS
        if (poll_err) {
            PyBuffer_Release(&view);
            errno = poll_err;
            /* Not OSError: that is a read's, and would end the session. */
            return PyErr_SetFromErrno(PyExc_RuntimeError);
        }
        if (woken) {
            result = WOKEN;
            break;
        }
        if (n > 0) {
            const unsigned char *b = view.buf;
            uint32_t op, uid, gid, pid;
            uint64_t unique, ino;
            if (n < IN_HEADER) {
                result = n; /* Python's to make sense of */
                break;
            }
            memcpy(&op, b + 4, 4);
            memcpy(&unique, b + 8, 8);
            memcpy(&ino, b + 16, 8);
            memcpy(&uid, b + 24, 4);
            memcpy(&gid, b + 28, 4);
            memcpy(&pid, b + 32, 4);
            if (op == OP_IOCTL) {
                struct {
                    uint32_t len;
                    int32_t error;
                    uint64_t unique;
                } reply = {OUT_HEADER, -ENOTTY, unique};
                write_reply(self, &reply, sizeof reply);
                self->ioctls++;
                answered++;
                yield_cpu();
                continue;
            }
            int done = 0;
            if (op == OP_OPEN)
                done = try_open(self, b, n, unique, ino, uid, gid, pid);
            else if (op == OP_GETATTR)
                done = try_getattr(self, unique, ino);
            else if (op == OP_LOOKUP)
                done = try_lookup(self, b, n, unique, ino);
            if (done) {
                answered++;
                yield_cpu();
                continue;
            }
            result = n;
            break;
        }
        if (n == 0 || err == EAGAIN) {
            /* Nothing now: after answers, back to Python before any wait (its
               hold bookkeeping); else the poll timed out. */
            result = answered ? ANSWERED : (polled ? TIMED_OUT : NOTHING);
            break;
        }
        if (err == EINTR || err == ENOENT) { /* ENOENT: interrupted before it was read */
            result = answered ? ANSWERED : NOTHING;
            break;
        }
        PyBuffer_Release(&view);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyBuffer_Release(&view);
    return PyLong_FromLong(result);
}

/* ``check``'s path (str or bytes, in the filesystem's encoding, so that a
   name that is not UTF-8 is kept as it is; None: no check) and identity
   (FILE_IDENTITY or, for a directory, DIR_IDENTITY fields); 0 or -1. */
static int set_check(Check *check, PyObject *path, PyObject *identity, int directory) {
    int64_t id[DIR_IDENTITY] = {0};
    char *copy = NULL;
    if (path != Py_None) {
        Py_ssize_t want = directory ? DIR_IDENTITY : FILE_IDENTITY;
        if (!PyTuple_Check(identity) || PyTuple_GET_SIZE(identity) != want) {
            PyErr_Format(PyExc_TypeError, "a %s's identity is a tuple of %zd ints",
                         directory ? "directory" : "manifest", want);
            return -1;
        }
        for (Py_ssize_t i = 0; i < want; i++) {
            id[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(identity, i));
            if (id[i] == -1 && PyErr_Occurred())
                return -1;
        }
        PyObject *raw = NULL;
        if (!PyUnicode_FSConverter(path, &raw))
            return -1;
        size_t len = (size_t)PyBytes_GET_SIZE(raw);
        copy = PyMem_Malloc(len + 1);
        if (copy != NULL)
            memcpy(copy, PyBytes_AS_STRING(raw), len + 1);
        Py_DECREF(raw);
        if (copy == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    PyMem_Free(check->path);
    check->path = copy;
    memcpy(check->identity, id, sizeof id);
    check->directory = directory;
    return 0;
}

/* ``reply`` must be exactly ``size`` bytes (the session's packing of it). */
static int copy_reply(unsigned char *into, Py_buffer *reply, size_t size) {
    if ((size_t)reply->len != size) {
        PyErr_Format(PyExc_ValueError, "a reply of %zu bytes, not %zd", size, reply->len);
        return -1;
    }
    memcpy(into, reply->buf, size);
    return 0;
}

static PyObject *Reader_issue(Reader *self, PyObject *args) {
    unsigned long long ino;
    double deadline, recheck = 0.0;
    unsigned int flags, later;
    PyObject *manifest = Py_None, *identity = Py_None;
    if (!PyArg_ParseTuple(args, "KdII|OOd", &ino, &deadline, &flags, &later, &manifest,
                          &identity, &recheck))
        return NULL;
    Ticket *t = &self->tickets[ino % TICKETS];
    t->epoch = 0; /* nothing half-issued stays valid */
    if (set_check(&t->check, manifest, identity, 0) < 0)
        return NULL;
    t->recheck = recheck;
    t->ino = ino;
    t->deadline = deadline;
    t->flags = flags;
    t->later = later;
    t->epoch = self->epoch;
    Py_RETURN_NONE;
}

static PyObject *Reader_issue_attr(Reader *self, PyObject *args) {
    unsigned long long ino;
    double deadline, recheck;
    Py_buffer reply;
    PyObject *path = Py_None, *identity = Py_None;
    int directory = 0;
    if (!PyArg_ParseTuple(args, "Kdy*d|OOp", &ino, &deadline, &reply, &recheck, &path,
                          &identity, &directory))
        return NULL;
    AttrTicket *t = &self->attrs[ino % TICKETS];
    t->epoch = 0;
    int failed = copy_reply(t->reply, &reply, ATTR_OUT) < 0 ||
                 set_check(&t->check, path, identity, directory) < 0;
    PyBuffer_Release(&reply);
    if (failed)
        return NULL;
    t->ino = ino;
    t->deadline = deadline;
    t->recheck = recheck;
    t->epoch = self->epoch;
    Py_RETURN_NONE;
}

static PyObject *Reader_issue_entry(Reader *self, PyObject *args) {
    unsigned long long parent, child;
    Py_buffer name, reply;
    PyObject *path, *identity;
    int directory;
    if (!PyArg_ParseTuple(args, "Ky*Ky*OOp", &parent, &name, &child, &reply, &path, &identity,
                          &directory))
        return NULL;
    int failed = 0;
    if (name.len == 0 || name.len > NAME_MAX_LEN || memchr(name.buf, 0, (size_t)name.len)) {
        PyErr_SetString(PyExc_ValueError, "a name of 1 to 255 bytes, without NUL");
        failed = 1;
    }
    if (!failed) {
        EntryTicket *e = &self->entries[entry_slot(parent, name.buf, (size_t)name.len)];
        e->epoch = 0;
        failed = path == Py_None || copy_reply(e->reply, &reply, ENTRY_OUT) < 0 ||
                 set_check(&e->check, path, identity, directory) < 0;
        if (path == Py_None)
            PyErr_SetString(PyExc_TypeError, "an entry ticket is checked each time: a path");
        if (!failed) {
            e->parent = parent;
            e->child = child;
            e->name_len = (size_t)name.len;
            memcpy(e->name, name.buf, (size_t)name.len);
            e->epoch = self->epoch;
        }
    }
    PyBuffer_Release(&name);
    PyBuffer_Release(&reply);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Reader_checks_in(Reader *self, PyObject *arg) {
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    self->store_fd = (int)fd;
    Py_RETURN_NONE;
}

static PyObject *Reader_withdraw(Reader *self, PyObject *arg) {
    unsigned long long ino = PyLong_AsUnsignedLongLong(arg);
    if (ino == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Ticket *t = &self->tickets[ino % TICKETS];
    if (t->ino == ino)
        t->epoch = 0;
    AttrTicket *a = &self->attrs[ino % TICKETS];
    if (a->ino == ino)
        a->epoch = 0;
    Py_RETURN_NONE;
}

static PyObject *Reader_withdraw_entry(Reader *self, PyObject *args) {
    unsigned long long parent;
    Py_buffer name;
    if (!PyArg_ParseTuple(args, "Ky*", &parent, &name))
        return NULL;
    EntryTicket *e = &self->entries[entry_slot(parent, name.buf, (size_t)name.len)];
    if (e->parent == parent && e->name_len == (size_t)name.len &&
        memcmp(e->name, name.buf, (size_t)name.len) == 0)
        e->epoch = 0;
    PyBuffer_Release(&name);
    Py_RETURN_NONE;
}

static PyObject *Reader_invalidate(Reader *self, PyObject *Py_UNUSED(ignored)) {
    self->epoch++;
    Py_RETURN_NONE;
}

static PyObject *Reader_drain(Reader *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(self->n_opened);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < self->n_opened; i++) {
        const Opened *o = &self->opened[i];
        PyObject *item = Py_BuildValue("(KKIIId)", (unsigned long long)o->fh,
                                       (unsigned long long)o->ino, o->uid, o->gid, o->pid,
                                       o->checked_at);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    self->n_opened = 0;
    return out;
}

static PyObject *Reader_drain_seen(Reader *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(self->n_seen);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < self->n_seen; i++) {
        const Seen *o = &self->seen[i];
        PyObject *item = Py_BuildValue("(KOd)", (unsigned long long)o->ino,
                                       o->lookup ? Py_True : Py_False, o->checked_at);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    self->n_seen = 0;
    return out;
}

static PyObject *Reader_fs_magic(PyObject *Py_UNUSED(cls), PyObject *arg) {
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    struct statfs sf;
    if (fstatfs((int)fd, &sf) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromUnsignedLong((unsigned long)sf.f_type);
}

static PyObject *Reader_get_pending(Reader *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(self->n_opened + self->n_seen);
}

static PyMethodDef Reader_methods[] = {
    {"serve", (PyCFunction)Reader_serve, METH_VARARGS,
     "serve(buf, timeout_ms) -> int: wait (up to timeout_ms, -1: no limit) and read; "
     "answer IOCTLs, ticketed read-only OPENs, GETATTRs and LOOKUPs; return a request's size (it is in buf), "
     "0 (the wait timed out), -1 (woken), -2 (answered, nothing more now), -3 (nothing read)."},
    {"issue", (PyCFunction)Reader_issue, METH_VARARGS,
     "issue(ino, deadline, open_flags, later_flags): a read-only open of ino may be answered "
     "until deadline (time.monotonic()) while the epoch holds, the first with open_flags, "
     "the next with later_flags; state lock held. With manifest (a path under the store "
     "root given to checks_in), identity (dev, ino, size, mtime_ns, ctime_ns) and recheck: "
     "past the deadline, an open whose stat of the manifest finds that identity is "
     "answered too, and the ticket lasts recheck seconds from that check."},
    {"issue_attr", (PyCFunction)Reader_issue_attr, METH_VARARGS,
     "issue_attr(ino, deadline, reply, recheck[, path, identity, directory]): a GETATTR of "
     "ino is answered with reply (a fuse_attr_out) until deadline while the epoch holds; "
     "past it, once a stat of path finds identity (dev, ino, size, mtime_ns, ctime_ns, "
     "and for a directory atime_ns, nlink, mode, uid, gid), and then for recheck seconds "
     "more; state lock held."},
    {"issue_entry", (PyCFunction)Reader_issue_entry, METH_VARARGS,
     "issue_entry(parent, name, child, reply, path, identity, directory): a LOOKUP of name "
     "in parent is answered with reply (a fuse_entry_out of child) while the epoch holds, "
     "each time a stat of path finds identity; state lock held."},
    {"withdraw_entry", (PyCFunction)Reader_withdraw_entry, METH_VARARGS,
     "withdraw_entry(parent, name): its entry ticket, if any."},
    {"drain_seen", (PyCFunction)Reader_drain_seen, METH_NOARGS,
     "The GETATTRs and LOOKUPs answered since the last drain that the filesystem must "
     "know of: [(ino, lookup, checked_at)]: lookup True for a LOOKUP (one more kernel "
     "reference), checked_at the time.monotonic() a check of its own began that found the "
     "entry the last look found (0.0: none) (state lock held)."},
    {"checks_in", (PyCFunction)Reader_checks_in, METH_O,
     "checks_in(fd): the local store's root directory, for the checks of tickets that "
     "name a manifest (-1: none)."},
    {"withdraw", (PyCFunction)Reader_withdraw, METH_O,
     "withdraw(ino): its open and attr tickets, if any."},
    {"invalidate", (PyCFunction)Reader_invalidate, METH_NOARGS,
     "Every ticket: the state may change now (state lock held)."},
    {"drain", (PyCFunction)Reader_drain, METH_NOARGS,
     "The handles given out since the last drain: [(fh, ino, uid, gid, pid, checked_at)], "
     "checked_at the time.monotonic() its own check began, 0.0 if none (state lock held)."},
    {"fs_magic", (PyCFunction)Reader_fs_magic, METH_O | METH_STATIC,
     "fs_magic(fd) -> int: the f_type fstatfs(2) gives for fd's filesystem."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Reader_members[] = {
    {"opens", T_ULONGLONG, offsetof(Reader, opens), READONLY, "read-only OPENs answered"},
    {"ioctls", T_ULONGLONG, offsetof(Reader, ioctls), READONLY, "IOCTLs answered (ENOTTY)"},
    {"getattrs", T_ULONGLONG, offsetof(Reader, getattrs), READONLY, "GETATTRs answered"},
    {"lookups", T_ULONGLONG, offsetof(Reader, lookups), READONLY, "LOOKUPs answered"},
    {"checks", T_ULONGLONG, offsetof(Reader, checks), READONLY,
     "checks of its own (a stat of the local store)"},
    {"write_errors", T_ULONGLONG, offsetof(Reader, write_errors), READONLY,
     "replies the kernel refused (not ENOENT or ENODEV)"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Reader_getset[] = {
    {"pending", (getter)Reader_get_pending, NULL,
     "handles given out and answers to tell of, not yet drained", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ckptfs.fs._fastreader.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The request thread's compiled reader of one FUSE connection.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reader_init,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Reader_methods,
    .tp_members = Reader_members,
    .tp_getset = Reader_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ckptfs.fs._fastreader",
    "The request thread's compiled reader (see fs/_fastreader.c).", -1, NULL,
};

PyMODINIT_FUNC PyInit__fastreader(void) {
    str_loop_waits = PyUnicode_InternFromString("loop_waits");
    str_acquire = PyUnicode_InternFromString("acquire");
    str_release = PyUnicode_InternFromString("release");
    if (!str_loop_waits || !str_acquire || !str_release)
        return NULL;
    if (PyType_Ready(&ReaderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Reader", (PyObject *)&ReaderType) < 0 ||
        PyModule_AddIntConstant(m, "TIMED_OUT", TIMED_OUT) < 0 ||
        PyModule_AddIntConstant(m, "WOKEN", WOKEN) < 0 ||
        PyModule_AddIntConstant(m, "ANSWERED", ANSWERED) < 0 ||
        PyModule_AddIntConstant(m, "NOTHING", NOTHING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyObject *first = PyLong_FromUnsignedLongLong(FIRST_FH);
    if (first == NULL || PyModule_AddObject(m, "FIRST_FH", first) < 0) {
        Py_XDECREF(first);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
