/*
 * One directory of a /fs/list answer, scanned and formatted in C.
 *
 * Loaded with ctypes by fastlist.py, which keeps the Python path as the
 * reference and the fallback: for every entry this writes exactly the JSON
 * text the Python path writes (fsops.FileOps._scan_py), so the two are
 * interchangeable byte for byte (tests/dataplane/test_fastlist.py compares
 * them on names of random bytes).
 *
 *   {"path":"<prefix><name>","is_dir":<bool>,"size":<n>,
 *    "modified_at":"<YYYY-MM-DDTHH:MM:SS>.<ms>Z"[,"is_symlink":true]}
 *
 * The name is JSON-escaped as Python's encode_basestring_ascii does it after
 * os.fsdecode: valid UTF-8 becomes \uXXXX escapes (surrogate pairs beyond the
 * BMP), every byte outside valid UTF-8 becomes \udcXX.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct buf {
    char *data;
    size_t len, cap;
};

struct scan_result {
    char *json;       /* entries joined by ',' (no brackets) */
    size_t json_len;
    char *subdirs;    /* names of the directories among them, each NUL-terminated */
    size_t subdirs_len;
    long count;       /* entries written */
    int truncated;    /* 1 when `limit` entries were written and more remained */
    int error;        /* 0, an errno, or -1: an entry this code does not format (use Python) */
};

static int reserve(struct buf *b, size_t more) {
    if (b->len + more <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 65536;
    while (cap < b->len + more) cap *= 2;
    char *p = realloc(b->data, cap);
    if (p == NULL) return -1;
    b->data = p;
    b->cap = cap;
    return 0;
}

static void put(struct buf *b, const char *s, size_t n) {
    memcpy(b->data + b->len, s, n);
    b->len += n;
}

/* Appends a string literal. */
#define PUTS(b, lit) put((b), (lit), sizeof(lit) - 1)

static const char HEX[] = "0123456789abcdef";

static void put_u(struct buf *b, unsigned cp) {
    char e[6] = {'\\', 'u', HEX[(cp >> 12) & 15], HEX[(cp >> 8) & 15], HEX[(cp >> 4) & 15],
                 HEX[cp & 15]};
    put(b, e, 6);
}

/* Length of the valid UTF-8 sequence at s (Unicode table 3-7), 0 when invalid. */
static size_t utf8_seq(const unsigned char *s, size_t n, unsigned *cp) {
    unsigned c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    if (c >= 0xC2 && c <= 0xDF) {
        if (n < 2 || (s[1] & 0xC0) != 0x80) return 0;
        *cp = ((c & 0x1F) << 6) | (s[1] & 0x3F);
        return 2;
    }
    if (c >= 0xE0 && c <= 0xEF) {
        unsigned lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
        if (n < 3 || s[1] < lo || s[1] > hi || (s[2] & 0xC0) != 0x80) return 0;
        *cp = ((c & 0x0F) << 12) | ((s[1] & 0x3F) << 6) | (s[2] & 0x3F);
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        unsigned lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
        if (n < 4 || s[1] < lo || s[1] > hi || (s[2] & 0xC0) != 0x80 || (s[3] & 0xC0) != 0x80)
            return 0;
        *cp = ((c & 0x07) << 18) | ((s[1] & 0x3F) << 12) | ((s[2] & 0x3F) << 6) | (s[3] & 0x3F);
        return 4;
    }
    return 0;
}

/* Appends the escaped name (at most 6 output bytes per input byte). */
static void put_name(struct buf *b, const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned cp;
        size_t k = utf8_seq(s + i, n - i, &cp);
        if (k == 0) {
            put_u(b, 0xDC00 | s[i]); /* surrogateescape */
            i++;
            continue;
        }
        i += k;
        if (cp == '"') {
            PUTS(b, "\\\"");
        } else if (cp == '\\') {
            PUTS(b, "\\\\");
        } else if (cp >= 0x20 && cp <= 0x7E) {
            b->data[b->len++] = (char)cp;
        } else if (cp == '\n') {
            PUTS(b, "\\n");
        } else if (cp == '\r') {
            PUTS(b, "\\r");
        } else if (cp == '\t') {
            PUTS(b, "\\t");
        } else if (cp == '\b') {
            PUTS(b, "\\b");
        } else if (cp == '\f') {
            PUTS(b, "\\f");
        } else if (cp >= 0x10000) {
            cp -= 0x10000;
            put_u(b, 0xD800 | (cp >> 10));
            put_u(b, 0xDC00 | (cp & 0x3FF));
        } else {
            put_u(b, cp);
        }
    }
}

/* Python's iso(st.st_mtime): the float st_mtime, its integer part, its milliseconds. */
static int put_mtime(struct buf *b, const struct stat *st) {
    double ts = (double)st->st_mtim.tv_sec + (double)st->st_mtim.tv_nsec * 1e-9;
    if (!(ts > -9.0e18 && ts < 9.0e18)) return -1;
    long long sec = (long long)ts; /* int(ts): toward zero */
    long long ms = (long long)((ts - (double)sec) * 1000.0);
    time_t t = (time_t)sec;
    struct tm tm;
    if (gmtime_r(&t, &tm) == NULL) return -1;
    char when[64];
    size_t w = strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
    if (w == 0) return -1;
    int m = snprintf(when + w, sizeof when - w, ".%03lldZ", ms);
    if (m < 0 || (size_t)m >= sizeof when - w) return -1;
    put(b, when, w + (size_t)m);
    return 0;
}

int sandlot_scan(int fd, const char *prefix, size_t prefix_len, long limit, int want_subdirs,
                 struct scan_result *out) {
    struct buf json = {0}, subdirs = {0};
    memset(out, 0, sizeof *out);
    int dfd = dup(fd);
    if (dfd < 0) {
        out->error = errno;
        return -1;
    }
    DIR *dir = fdopendir(dfd);
    if (dir == NULL) {
        out->error = errno;
        close(dfd);
        return -1;
    }
    rewinddir(dir);
    long count = 0;
    int error = 0;
    for (;;) {
        errno = 0;
        struct dirent *e = readdir(dir);
        if (e == NULL) {
            error = errno;
            break;
        }
        const char *name = e->d_name;
        if (name[0] == '.' && (name[1] == 0 || (name[1] == '.' && name[2] == 0))) continue;
        if (count >= limit) {
            out->truncated = 1;
            break;
        }
        struct stat st;
        if (fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue; /* gone: skipped */
        size_t n = strlen(name);
        if (reserve(&json, prefix_len + 6 * n + 200) != 0) {
            error = ENOMEM;
            break;
        }
        size_t mark = json.len;
        if (count) PUTS(&json, ",");
        PUTS(&json, "{\"path\":\"");
        put(&json, prefix, prefix_len);
        put_name(&json, (const unsigned char *)name, n);
        int is_dir = S_ISDIR(st.st_mode);
        if (is_dir)
            PUTS(&json, "\",\"is_dir\":true,\"size\":");
        else
            PUTS(&json, "\",\"is_dir\":false,\"size\":");
        char num[32];
        int k = snprintf(num, sizeof num, "%lld", (long long)st.st_size);
        put(&json, num, (size_t)k);
        PUTS(&json, ",\"modified_at\":\"");
        if (put_mtime(&json, &st) != 0) {
            json.len = mark;
            error = -1;
            break;
        }
        PUTS(&json, "\"");
        if (S_ISLNK(st.st_mode)) PUTS(&json, ",\"is_symlink\":true");
        PUTS(&json, "}");
        count++;
        if (is_dir && want_subdirs) {
            if (reserve(&subdirs, n + 1) != 0) {
                error = ENOMEM;
                break;
            }
            put(&subdirs, name, n + 1);
        }
    }
    rewinddir(dir); /* the offset is shared with fd: leave it as found, like scandir */
    closedir(dir);
    out->json = json.data;
    out->json_len = json.len;
    out->subdirs = subdirs.data;
    out->subdirs_len = subdirs.len;
    out->count = count;
    out->error = error;
    return error ? -1 : 0;
}

void sandlot_scan_free(struct scan_result *r) {
    free(r->json);
    free(r->subdirs);
    r->json = r->subdirs = NULL;
}
