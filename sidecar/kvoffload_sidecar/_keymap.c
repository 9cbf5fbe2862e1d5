/* A hash map from fixed-size byte keys to slot numbers: the sidecar index's key -> slot table.

   Why native: the pool answers a 1,024-key lookup or reservation in one call, and in Python
   that is 1,024 bytes objects cut from the request plus 1,024 dict probes (~45 µs on a 2-core
   VM, 2x that on the GPU host) before any state is checked. Here one pass over the packed
   request hashes and probes each key in place and hands back the slots as one int64 buffer
   (numpy wraps it without a copy). keymap.py falls back to a dict subclass with the same
   methods when this module is not built.

   Open addressing, linear probing, tombstones; a bucket is its tag, its slot and its key inline
   (16 + key_size bytes, 8-aligned), so a probe touches one cache line, not three arrays. The hash is seeded per map (keys are chosen by clients). Not thread-safe on its own:
   the pool calls it under its lock, with the GIL held throughout. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define EMPTY 0u
#define TOMB 1u
#define MIN_CAP 16

typedef struct {
    PyObject_HEAD
    Py_ssize_t key_size;
    Py_ssize_t mask;   /* capacity - 1; capacity is a power of two */
    Py_ssize_t len;    /* live keys */
    Py_ssize_t used;   /* live keys + tombstones */
    Py_ssize_t stride; /* bytes per bucket */
    uint64_t seed;
    unsigned char *buckets; /* capacity x stride: tag (EMPTY, TOMB or the key's hash), slot, key */
} KeyMap;

#define TAG(m, i) (*(uint64_t *)((m)->buckets + (i) * (m)->stride))
#define VAL(m, i) (*(int64_t *)((m)->buckets + (i) * (m)->stride + 8))
#define KEY(m, i) ((m)->buckets + (i) * (m)->stride + 16)

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 32;
    x *= 0xd6e8feb86659fd93ULL;
    x ^= x >> 32;
    x *= 0xd6e8feb86659fd93ULL;
    x ^= x >> 32;
    return x;
}

static inline uint64_t tag_of(const KeyMap *m, const unsigned char *k) {
    Py_ssize_t n = m->key_size;
    uint64_t h = m->seed ^ ((uint64_t)n * 0x9E3779B97F4A7C15ULL);
    uint64_t w;
    while (n >= 8) {
        memcpy(&w, k, 8);
        h = (h ^ w) * 0x9E3779B97F4A7C15ULL;
        h ^= h >> 29;
        k += 8;
        n -= 8;
    }
    if (n) {
        w = 0;
        memcpy(&w, k, (size_t)n);
        h = (h ^ w ^ ((uint64_t)n << 56)) * 0x9E3779B97F4A7C15ULL;
    }
    h = mix64(h);
    return h < 2 ? h + 2 : h;
}

/* Bucket holding key k (with tag t), or -1. */
static inline Py_ssize_t find(const KeyMap *m, const unsigned char *k, uint64_t t) {
    Py_ssize_t i = (Py_ssize_t)(t & (uint64_t)m->mask), ks = m->key_size;
    for (;;) {
        uint64_t cur = TAG(m, i);
        if (cur == EMPTY)
            return -1;
        if (cur == t && memcmp(KEY(m, i), k, (size_t)ks) == 0)
            return i;
        i = (i + 1) & m->mask;
    }
}

/* Slots of the longest prefix of the n packed keys that is in the map, into out; returns its
   length. Tags of a group are computed and their buckets prefetched before any is probed: the
   misses of a large map overlap instead of queueing. */
#define GROUP 16
static Py_ssize_t prefix_slots(const KeyMap *m, const unsigned char *keys, Py_ssize_t n,
                               int64_t *out) {
    uint64_t tags[GROUP];
    Py_ssize_t ks = m->key_size;
    for (Py_ssize_t base = 0; base < n; base += GROUP) {
        Py_ssize_t g = n - base < GROUP ? n - base : GROUP;
        for (Py_ssize_t j = 0; j < g; j++) {
            tags[j] = tag_of(m, keys + (base + j) * ks);
            __builtin_prefetch(m->buckets + (Py_ssize_t)(tags[j] & (uint64_t)m->mask) * m->stride);
        }
        for (Py_ssize_t j = 0; j < g; j++) {
            Py_ssize_t i = find(m, keys + (base + j) * ks, tags[j]);
            if (i < 0)
                return base + j;
            out[base + j] = VAL(m, i);
        }
    }
    return n;
}

static int alloc_table(KeyMap *m, Py_ssize_t cap) {
    unsigned char *buckets = PyMem_Calloc((size_t)cap, (size_t)m->stride);
    if (!buckets) {
        PyErr_NoMemory();
        return -1;
    }
    m->buckets = buckets;
    m->mask = cap - 1;
    m->used = m->len = 0;
    return 0;
}

/* Place a key known to be absent (no tombstones in a fresh table, so the first empty bucket). */
static void place_fresh(KeyMap *m, const unsigned char *k, uint64_t t, int64_t v) {
    Py_ssize_t i = (Py_ssize_t)(t & (uint64_t)m->mask);
    while (TAG(m, i) != EMPTY)
        i = (i + 1) & m->mask;
    TAG(m, i) = t;
    VAL(m, i) = v;
    memcpy(KEY(m, i), k, (size_t)m->key_size);
    m->used++;
    m->len++;
}

/* Make room for `extra` more keys: rehash (dropping tombstones) when the load would pass 2/3. */
static int reserve_room(KeyMap *m, Py_ssize_t extra) {
    Py_ssize_t cap = m->mask + 1;
    if ((m->used + extra) * 3 <= cap * 2)
        return 0;
    Py_ssize_t want = MIN_CAP;
    while (want * 2 < (m->len + extra) * 3 + 1)
        want <<= 1;
    KeyMap old = *m;
    if (alloc_table(m, want) < 0) {
        *m = old;
        return -1;
    }
    for (Py_ssize_t i = 0; i <= old.mask; i++) {
        if (TAG(&old, i) > TOMB)
            place_fresh(m, KEY(&old, i), TAG(&old, i), VAL(&old, i));
    }
    PyMem_Free(old.buckets);
    return 0;
}

/* Insert an absent key (room already reserved): the first empty or tombstone bucket. */
static Py_ssize_t insert_absent(KeyMap *m, const unsigned char *k, uint64_t t, int64_t v) {
    Py_ssize_t i = (Py_ssize_t)(t & (uint64_t)m->mask);
    while (TAG(m, i) > TOMB)
        i = (i + 1) & m->mask;
    if (TAG(m, i) == EMPTY)
        m->used++;
    TAG(m, i) = t;
    VAL(m, i) = v;
    memcpy(KEY(m, i), k, (size_t)m->key_size);
    m->len++;
    return i;
}

static void remove_at(KeyMap *m, Py_ssize_t i) {
    m->len--;
    if (TAG(m, (i + 1) & m->mask) == EMPTY) { /* end of a run: no probe passes through here */
        TAG(m, i) = EMPTY;
        m->used--;
        for (Py_ssize_t j = (i - 1) & m->mask; TAG(m, j) == TOMB; j = (j - 1) & m->mask) {
            TAG(m, j) = EMPTY;
            m->used--;
        }
    } else {
        TAG(m, i) = TOMB;
    }
}

/* -- argument helpers ------------------------------------------------------------------------ */

static int not_ready(KeyMap *m) {
    if (m->buckets)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "KeyMap.__init__ was not called");
    return 1;
}

/* A key argument as (pointer, ok): ok 0 when it is bytes of another size (never a member). */
static int key_arg(KeyMap *m, PyObject *key, const unsigned char **out) {
    if (not_ready(m))
        return -1;
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "keys are bytes, got %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    if (PyBytes_GET_SIZE(key) != m->key_size)
        return 0;
    *out = (const unsigned char *)PyBytes_AS_STRING(key);
    return 1;
}

static int packed_arg(KeyMap *m, Py_buffer *buf, Py_ssize_t *n) {
    if (not_ready(m))
        return -1;
    if (buf->len % m->key_size) {
        PyErr_Format(PyExc_ValueError, "packed keys are %zd bytes, not a multiple of %zd",
                     buf->len, m->key_size);
        return -1;
    }
    *n = buf->len / m->key_size;
    return 0;
}

/* The bucket of a key argument into *i (-1 when absent: another size is never a member);
   -1 with an exception set when the argument is no bytes. */
static int bucket_of(KeyMap *m, PyObject *key, Py_ssize_t *i) {
    const unsigned char *k;
    int ok = key_arg(m, key, &k);
    if (ok < 0)
        return -1;
    *i = ok ? find(m, k, tag_of(m, k)) : -1;
    return 0;
}

static PyObject *int64_bytes(Py_ssize_t n, int64_t **data) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (out)
        *data = (int64_t *)PyBytes_AS_STRING(out);
    return out;
}

/* -- type slots ------------------------------------------------------------------------------ */

static int KeyMap_init(KeyMap *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"key_size", "seed", NULL};
    Py_ssize_t key_size;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|K", kwlist, &key_size, &seed))
        return -1;
    if (key_size < 1 || key_size > 4096) {
        PyErr_Format(PyExc_ValueError, "key_size must be in 1..4096, got %zd", key_size);
        return -1;
    }
    if (self->buckets) {
        PyErr_SetString(PyExc_RuntimeError, "KeyMap is already initialised");
        return -1;
    }
    self->key_size = key_size;
    self->stride = 16 + ((key_size + 7) & ~(Py_ssize_t)7);
    self->seed = mix64((uint64_t)seed ^ 0x243F6A8885A308D3ULL);
    return alloc_table(self, MIN_CAP);
}

static void KeyMap_dealloc(KeyMap *self) {
    PyMem_Free(self->buckets);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t KeyMap_len(KeyMap *self) { return self->len; }

static int KeyMap_contains(KeyMap *self, PyObject *key) {
    Py_ssize_t i;
    if (bucket_of(self, key, &i) < 0)
        return -1;
    return i >= 0;
}

static PyObject *KeyMap_subscript(KeyMap *self, PyObject *key) {
    Py_ssize_t i;
    if (bucket_of(self, key, &i) < 0)
        return NULL;
    if (i < 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return PyLong_FromLongLong(VAL(self, i));
}

static int KeyMap_ass_subscript(KeyMap *self, PyObject *key, PyObject *value) {
    const unsigned char *k;
    int ok = key_arg(self, key, &k);
    if (ok < 0)
        return -1;
    uint64_t t = ok ? tag_of(self, k) : 0;
    Py_ssize_t i = ok ? find(self, k, t) : -1;
    if (value == NULL) {
        if (i < 0) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        remove_at(self, i);
        return 0;
    }
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "key of %zd bytes in a map of %zd-byte keys",
                     PyBytes_GET_SIZE(key), self->key_size);
        return -1;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (i >= 0) {
        VAL(self, i) = v;
        return 0;
    }
    if (reserve_room(self, 1) < 0)
        return -1;
    insert_absent(self, k, t, v);
    return 0;
}

/* -- methods ---------------------------------------------------------------------------------- */

static PyObject *KeyMap_get(KeyMap *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    Py_ssize_t i;
    if (bucket_of(self, args[0], &i) < 0)
        return NULL;
    if (i >= 0)
        return PyLong_FromLongLong(VAL(self, i));
    PyObject *dflt = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(dflt);
    return dflt;
}

static PyObject *KeyMap_pop(KeyMap *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key, default)");
        return NULL;
    }
    Py_ssize_t i;
    if (bucket_of(self, args[0], &i) < 0)
        return NULL;
    if (i < 0) {
        Py_INCREF(args[1]);
        return args[1];
    }
    PyObject *v = PyLong_FromLongLong(VAL(self, i));
    if (v)
        remove_at(self, i);
    return v;
}

static PyObject *KeyMap_items(KeyMap *self, PyObject *Py_UNUSED(ignored)) {
    if (not_ready(self))
        return NULL;
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    for (Py_ssize_t i = 0; i <= self->mask; i++) {
        if (TAG(self, i) <= TOMB)
            continue;
        PyObject *item = Py_BuildValue(
            "(y#L)", (const char *)KEY(self, i), self->key_size,
            (long long)VAL(self, i));
        if (!item || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

static PyObject *KeyMap_prefix(KeyMap *self, PyObject *arg) {
    /* Slots (int64 bytes) of the longest prefix of the packed keys that is in the map. */
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t n, hit = 0;
    PyObject *out = NULL;
    int64_t *data;
    if (packed_arg(self, &buf, &n) == 0 && (out = int64_bytes(n, &data)) != NULL) {
        hit = prefix_slots(self, buf.buf, n, data);
        if (hit < n)
            _PyBytes_Resize(&out, hit * (Py_ssize_t)sizeof(int64_t));
    }
    PyBuffer_Release(&buf);
    return out;
}

static PyObject *KeyMap_insert_new(KeyMap *self, PyObject *const *args, Py_ssize_t nargs) {
    /* insert_new(packed keys, int64 slots): map every key to its slot when none is in the map
       and none repeats, and return True; else change nothing and return False. */
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "insert_new(packed_keys, slots)");
        return NULL;
    }
    Py_buffer keys, slots;
    if (PyObject_GetBuffer(args[0], &keys, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &slots, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n, ks = self->key_size;
    if (packed_arg(self, &keys, &n) < 0)
        goto done;
    if (slots.len != n * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "%zd keys for %zd bytes of int64 slots", n, slots.len);
        goto done;
    }
    if (reserve_room(self, n) < 0)
        goto done;
    const unsigned char *k = keys.buf;
    const int64_t *v = slots.buf;
    Py_ssize_t j;
    for (j = 0; j < n; j++, k += ks) {
        uint64_t t = tag_of(self, k);
        if (find(self, k, t) >= 0)
            break;
        insert_absent(self, k, t, v[j]);
    }
    if (j == n) {
        result = Py_True;
    } else { /* a key was there (or repeated): take out the ones this call put in */
        const unsigned char *u = keys.buf;
        for (Py_ssize_t r = 0; r < j; r++, u += ks)
            remove_at(self, find(self, u, tag_of(self, u)));
        result = Py_False;
    }
    Py_INCREF(result);
done:
    PyBuffer_Release(&keys);
    PyBuffer_Release(&slots);
    return result;
}

static PyMethodDef KeyMap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))KeyMap_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))KeyMap_pop, METH_FASTCALL, "pop(key, default)"},
    {"items", (PyCFunction)KeyMap_items, METH_NOARGS, "list of (key, slot) pairs"},
    {"prefix", (PyCFunction)KeyMap_prefix, METH_O,
     "prefix(packed) -> int64 bytes: slots of the longest prefix of keys in the map"},
    {"insert_new", (PyCFunction)(void (*)(void))KeyMap_insert_new, METH_FASTCALL,
     "insert_new(packed, int64 slots) -> bool: all keys new and distinct, else no change"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods KeyMap_as_sequence = {
    .sq_contains = (objobjproc)KeyMap_contains,
};

static PyMappingMethods KeyMap_as_mapping = {
    .mp_length = (lenfunc)KeyMap_len,
    .mp_subscript = (binaryfunc)KeyMap_subscript,
    .mp_ass_subscript = (objobjargproc)KeyMap_ass_subscript,
};

static PyTypeObject KeyMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvoffload_sidecar._keymap.KeyMap",
    .tp_doc = PyDoc_STR("Fixed-size bytes key -> int64 slot; batch calls on packed keys."),
    .tp_basicsize = sizeof(KeyMap),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)KeyMap_init,
    .tp_dealloc = (destructor)KeyMap_dealloc,
    .tp_methods = KeyMap_methods,
    .tp_as_sequence = &KeyMap_as_sequence,
    .tp_as_mapping = &KeyMap_as_mapping,
};

static struct PyModuleDef keymap_module = {
    PyModuleDef_HEAD_INIT, "_keymap", "The sidecar index's native key -> slot map.", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__keymap(void) {
    if (PyType_Ready(&KeyMapType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&keymap_module);
    if (!m)
        return NULL;
    Py_INCREF(&KeyMapType);
    if (PyModule_AddObject(m, "KeyMap", (PyObject *)&KeyMapType) < 0) {
        Py_DECREF(&KeyMapType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
