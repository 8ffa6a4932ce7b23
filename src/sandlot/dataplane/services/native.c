/*
 * The dataplane's file operations in C: one directory of a /fs/list answer
 * (sandlot_scan), the /fs/grep search of a small tree (sandlot_grep), and
 * the grep cache's copy of a small tree and its search (sandlot_grep_fill,
 * sandlot_grep_pack, at the end of this file).
 *
 * Loaded with ctypes by native.py, which keeps the Python paths as the
 * reference and the fallback: this writes exactly the JSON text the Python
 * paths write, so the two are interchangeable byte for byte
 * (tests/dataplane/test_native.py compares them on names and contents of
 * random bytes).
 *
 * A listing entry (fsops.FileOps._scan_py):
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
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

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

/* Appends the escape json.dumps writes for cp in both of its modes (the quote, the
 * backslash, a control character); 0 when cp has none. */
static int put_escape(struct buf *b, unsigned cp) {
    switch (cp) {
    case '"': PUTS(b, "\\\""); return 1;
    case '\\': PUTS(b, "\\\\"); return 1;
    case '\n': PUTS(b, "\\n"); return 1;
    case '\r': PUTS(b, "\\r"); return 1;
    case '\t': PUTS(b, "\\t"); return 1;
    case '\b': PUTS(b, "\\b"); return 1;
    case '\f': PUTS(b, "\\f"); return 1;
    }
    if (cp < 0x20) {
        put_u(b, cp);
        return 1;
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
        if (put_escape(b, cp)) continue;
        if (cp <= 0x7E) {
            b->data[b->len++] = (char)cp;
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
    long count = 0, skipped = 0;
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
        /* Entries that cannot be looked at count too: a directory of a million that the
         * user may list but not search (mode 0444) was read whole, on the event loop. */
        if (count + skipped >= limit) {
            out->truncated = 1;
            break;
        }
        struct stat st;
        if (fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) { /* gone, or not searchable */
            skipped++;
            continue;
        }
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

/* ---- /fs/grep of a small tree ---------------------------------------------------------
 *
 * The search grep.py's _search_small does in Python, with the same results in the same
 * JSON text (json.dumps with ensure_ascii=False), for a directory:
 *
 *   - every regular file below it, directories in name order, ".git" skipped, symlinks
 *     not followed (each component opened with O_NOFOLLOW relative to its parent),
 *     FIFOs, sockets, devices and unreadable directories left out;
 *   - files holding a NUL byte skipped as binary;
 *   - every line holding the literal pattern, once, with its 1-based number and at
 *     most MAX_LINE_CHARS characters of its text.
 *
 * Statuses: 0 done; 1 over a budget (more files than `count_limit`, more read than
 * `max_files` / `max_bytes`) or a file with a UTF-16 byte order mark: ripgrep's job;
 * 2 something only the Python path writes the same way (a name or a matched line that
 * is not valid UTF-8); a negative errno when memory ran out.
 */

#define MAX_LINE_CHARS 2000
/* Directories below the one searched; deeper trees go to ripgrep (grep.py's MAX_DEPTH). */
#define MAX_DEPTH 64

struct grep_result {
    char *json;      /* the first `cap` matches, JSON objects joined by ',' */
    size_t json_len;
    long count;      /* matches found, at most cap + 1 */
    int status;
};

struct grep_job {
    const unsigned char *pattern;
    size_t pattern_len;
    const unsigned char *glob; /* NULL: every file */
    size_t glob_len;
    long cap;
    long files_left, count_left;
    long long bytes_left;
    struct buf path; /* the JSON-escaped sandbox path of the directory being walked */
    struct buf json;
    unsigned char *data;
    size_t data_cap;
    long count;
    int status;
    /* sandlot_grep_fill only */
    int ifd;             /* the inotify instance that watches what is read */
    uint32_t mask;
    int unwatched;       /* something could not be watched: the copy must not be kept */
    int by_cwd;          /* watches by name, from the thread's own working directory */
    struct buf pack;
    int *wds;
    size_t nwds, wds_cap;
};

/* Appends s escaped as json.dumps(..., ensure_ascii=False) does; -1 if not valid UTF-8.
 * Stops after `max_chars` characters. */
static int put_text(struct buf *b, const unsigned char *s, size_t n, size_t max_chars) {
    if (reserve(b, 6 * n + 8) != 0) return -2;
    size_t i = 0, chars = 0;
    while (i < n && chars < max_chars) {
        unsigned cp;
        size_t k = utf8_seq(s + i, n - i, &cp);
        if (k == 0) return -1;
        chars++;
        if (!put_escape(b, cp)) put(b, (const char *)s + i, k);
        i += k;
    }
    return 0;
}

/* fnmatch.fnmatchcase(name, glob) for globs made of literal characters, '*' and '?'
 * (grep.py sends no other); '?' is one character, names are valid UTF-8. */
static int glob_match(const unsigned char *g, size_t gn, const unsigned char *s, size_t sn) {
    size_t gi = 0, si = 0, star_g = (size_t)-1, star_s = 0;
    while (si < sn) {
        if (gi < gn && g[gi] == '*') {
            star_g = ++gi;
            star_s = si;
            continue;
        }
        if (gi < gn && g[gi] == '?') {
            unsigned cp;
            size_t k = utf8_seq(s + si, sn - si, &cp);
            gi++;
            si += k ? k : 1;
            continue;
        }
        if (gi < gn && g[gi] == s[si]) {
            gi++;
            si++;
            continue;
        }
        if (star_g == (size_t)-1) return 0;
        /* Let the last '*' take one more character. */
        unsigned cp;
        size_t k = utf8_seq(s + star_s, sn - star_s, &cp);
        star_s += k ? k : 1;
        si = star_s;
        gi = star_g;
    }
    while (gi < gn && g[gi] == '*') gi++;
    return gi == gn;
}

struct name {
    char *s;
    unsigned char type;
};

static int by_name(const void *a, const void *b) {
    return strcmp(((const struct name *)a)->s, ((const struct name *)b)->s);
}

/* A small tree's directory holds at most this many entries: one with more is read no
 * further (its search is ripgrep's, in a process of its own), as reading and sorting a
 * directory of a million entries held the event loop for seconds. */
#define MAX_DIR_ENTRIES 4096

/* The entries of directory dfd but "." and "..", sorted by name; NULL with *n = 0 when
 * it cannot be read (the walk leaves it out, as ripgrep does), or with *big = 1 when it
 * holds more than MAX_DIR_ENTRIES. */
static struct name *entries(int dfd, size_t *n, int *oom, int *big) {
    *n = 0;
    int fd = dup(dfd);
    if (fd < 0) return NULL;
    DIR *dir = fdopendir(fd);
    if (dir == NULL) {
        close(fd);
        return NULL;
    }
    rewinddir(dir);
    struct name *out = NULL;
    size_t cap = 0;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        const char *s = e->d_name;
        if (s[0] == '.' && (s[1] == 0 || (s[1] == '.' && s[2] == 0))) continue;
        if (*n >= MAX_DIR_ENTRIES) {
            *big = 1;
            goto drop;
        }
        if (*n == cap) {
            cap = cap ? 2 * cap : 64;
            struct name *p = realloc(out, cap * sizeof *out);
            if (p == NULL) goto fail;
            out = p;
        }
        out[*n].s = strdup(s);
        if (out[*n].s == NULL) goto fail;
        out[*n].type = e->d_type;
        (*n)++;
    }
    rewinddir(dir);
    closedir(dir);
    if (*n > 1) qsort(out, *n, sizeof *out, by_name);
    return out;
fail:
    *oom = 1;
drop:
    for (size_t i = 0; i < *n; i++) free(out[i].s);
    free(out);
    *n = 0;
    closedir(dir);
    return NULL;
}

static void free_entries(struct name *list, size_t n) {
    for (size_t i = 0; i < n; i++) free(list[i].s);
    free(list);
}

/* Reads the regular file at fd whole into job->data: its length, or -1 to skip it. */
static long long read_file(struct grep_job *job, int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0) {
        job->status = 2; /* the Python path reports the error */
        return -1;
    }
    if (!S_ISREG(st.st_mode)) return -1;
    if (--job->files_left < 0 || st.st_size > job->bytes_left) {
        job->status = 1;
        return -1;
    }
    size_t want = (size_t)st.st_size + 1;
    size_t len = 0;
    for (;;) {
        if (len + 4096 > job->data_cap || want > job->data_cap) {
            size_t cap = job->data_cap ? job->data_cap : 65536;
            while (cap < len + 4096 || cap < want) cap *= 2;
            unsigned char *p = realloc(job->data, cap);
            if (p == NULL) {
                job->status = -ENOMEM;
                return -1;
            }
            job->data = p;
            job->data_cap = cap;
        }
        ssize_t got = read(fd, job->data + len, job->data_cap - len);
        if (got < 0) {
            if (errno == EINTR) continue;
            job->status = 2; /* the Python path reports the error */
            return -1;
        }
        if (got == 0) break;
        len += (size_t)got;
        if ((long long)len > job->bytes_left) {
            job->status = 1; /* grew while being read */
            return -1;
        }
    }
    job->bytes_left -= (long long)len;
    return (long long)len;
}

/* The '\n' bytes among s[0..n): 16 bytes a step where SSE2 is there (every x86-64). */
static long count_newlines(const unsigned char *s, size_t n) {
    long count = 0;
    size_t i = 0;
#ifdef __SSE2__
    const __m128i nl = _mm_set1_epi8('\n');
    for (; i + 16 <= n; i += 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)(s + i));
        count += __builtin_popcount((unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(v, nl)));
    }
#endif
    for (; i < n; i++) count += s[i] == '\n';
    return count;
}

/* Every line of data holding the pattern (grep.py's _scan). */
static void scan(struct grep_job *job, const unsigned char *data, size_t n, size_t path_len) {
    long line = 1;
    size_t counted = 0;
    const unsigned char *at = memmem(data, n, job->pattern, job->pattern_len);
    while (at != NULL && job->count <= job->cap) {
        size_t pos = (size_t)(at - data);
        const unsigned char *prev = pos ? memrchr(data, '\n', pos) : NULL;
        size_t start = prev ? (size_t)(prev - data) + 1 : 0;
        line += count_newlines(data + counted, start - counted);
        counted = start;
        const unsigned char *nl = memchr(data + pos, '\n', n - pos);
        size_t end = nl ? (size_t)(nl - data) : n;
        job->count++;
        if (job->count <= job->cap) {
            struct buf *b = &job->json;
            if (reserve(b, path_len + 80) != 0) {
                job->status = -ENOMEM;
                return;
            }
            size_t mark = b->len;
            if (job->count > 1) PUTS(b, ",");
            PUTS(b, "{\"path\":\"");
            put(b, job->path.data, path_len);
            char num[64];
            int k = snprintf(num, sizeof num, "\",\"line\":%ld,\"text\":\"", line);
            put(b, num, (size_t)k);
            size_t text_len = end - start;
            if (text_len > MAX_LINE_CHARS * 4) text_len = MAX_LINE_CHARS * 4;
            int rc = put_text(b, data + start, text_len, MAX_LINE_CHARS);
            if (rc != 0) {
                b->len = mark;
                job->status = rc == -1 ? 2 : -ENOMEM;
                return;
            }
            if (reserve(b, 2) != 0) {
                job->status = -ENOMEM;
                return;
            }
            PUTS(b, "\"}");
        }
        if (end >= n) break;
        at = memmem(data + end + 1, n - end - 1, job->pattern, job->pattern_len);
    }
}

/* Appends "/" and the escaped name to job->path, cut back to dir_len first; -1 (with
 * job->status set) when the name is not valid UTF-8 or memory ran out. */
static int push_name(struct grep_job *job, size_t dir_len, const char *s, size_t sn) {
    job->path.len = dir_len;
    if (reserve(&job->path, 6 * sn + 2) != 0) {
        job->status = -ENOMEM;
        return -1;
    }
    PUTS(&job->path, "/");
    int rc = put_text(&job->path, (const unsigned char *)s, sn, (size_t)-1);
    if (rc != 0) {
        job->status = rc == -1 ? 2 : -ENOMEM;
        return -1;
    }
    return 0;
}

/* What a file's bytes are to the search: 0 text, 1 binary (a NUL byte: skipped),
 * 2 UTF-16 with a byte order mark (ripgrep transcodes it). */
static unsigned char file_kind(const unsigned char *d, size_t len) {
    if (len >= 2 && ((d[0] == 0xFF && d[1] == 0xFE) || (d[0] == 0xFE && d[1] == 0xFF))) return 2;
    return memchr(d, 0, len) != NULL ? 1 : 0;
}

static int is_dir_entry(int dfd, const struct name *e, int *is_reg) {
    unsigned char t = e->type;
    if (t == DT_UNKNOWN) {
        struct stat st;
        if (fstatat(dfd, e->s, &st, AT_SYMLINK_NOFOLLOW) != 0) return -1;
        t = S_ISDIR(st.st_mode) ? DT_DIR : S_ISREG(st.st_mode) ? DT_REG : DT_UNKNOWN;
    }
    *is_reg = t == DT_REG;
    return t == DT_DIR;
}

/* Walks the tree below dfd: counts its regular files (search = 0) or searches them. */
static void walk(struct grep_job *job, int dfd, int search, int depth) {
    if (depth > MAX_DEPTH) {
        job->status = 1; /* ripgrep walks deep trees without recursion */
        return;
    }
    size_t n;
    int oom = 0, big = 0;
    struct name *list = entries(dfd, &n, &oom, &big);
    if (oom) {
        job->status = -ENOMEM;
        return;
    }
    if (big) {
        job->status = 1; /* not a small tree: ripgrep's */
        return;
    }
    size_t dir_len = job->path.len;
    for (size_t i = 0; i < n && job->status == 0 && job->count <= job->cap; i++) {
        const char *s = list[i].s;
        if (strcmp(s, ".git") == 0) continue;
        int is_reg = 0;
        int is_dir = is_dir_entry(dfd, &list[i], &is_reg);
        if (is_dir < 0 || (!is_dir && !is_reg)) continue;
        if (!search && is_reg) {
            if (--job->count_left < 0) job->status = 1;
            continue;
        }
        size_t sn = strlen(s);
        if (search && push_name(job, dir_len, s, sn) != 0) break;
        if (is_dir) {
            int sub = openat(dfd, s, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (sub < 0) continue; /* raced away or unreadable: skipped */
            walk(job, sub, search, depth + 1);
            close(sub);
            continue;
        }
        if (job->glob != NULL &&
            !glob_match(job->glob, job->glob_len, (const unsigned char *)s, sn))
            continue;
        int fd = openat(dfd, s, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
        if (fd < 0) continue;
        long long len = read_file(job, fd);
        close(fd);
        if (len < 0) continue;
        unsigned char kind = file_kind(job->data, (size_t)len);
        if (kind == 2) {
            job->status = 1; /* ripgrep's */
            break;
        }
        if (kind == 0) scan(job, job->data, (size_t)len, job->path.len);
    }
    job->path.len = dir_len;
    free_entries(list, n);
}

/* Hands a search's matches (or its status) over to the caller. */
static int finish(struct grep_job *job, struct grep_result *out) {
    if (job->status != 0) {
        free(job->json.data);
        out->status = job->status;
        return job->status;
    }
    out->json = job->json.data;
    out->json_len = job->json.len;
    out->count = job->count;
    return 0;
}

int sandlot_grep(int fd, const char *base, size_t base_len, const char *pattern,
                 size_t pattern_len, const char *glob, size_t glob_len, long cap,
                 long count_limit, long max_files, long long max_bytes,
                 struct grep_result *out) {
    memset(out, 0, sizeof *out);
    struct grep_job job = {0};
    job.pattern = (const unsigned char *)pattern;
    job.pattern_len = pattern_len;
    job.glob = (const unsigned char *)glob;
    job.glob_len = glob_len;
    job.cap = cap;
    job.count_left = count_limit;
    job.files_left = max_files;
    job.bytes_left = max_bytes;
    walk(&job, fd, 0, 0); /* count first: a large tree goes to ripgrep before any read */
    if (job.status == 0) {
        if (reserve(&job.path, base_len + 1) != 0) {
            job.status = -ENOMEM;
        } else {
            put(&job.path, base, base_len);
            walk(&job, fd, 1, 0);
        }
    }
    free(job.path.data);
    free(job.data);
    return finish(&job, out);
}

void sandlot_grep_free(struct grep_result *r) {
    free(r->json);
    r->json = NULL;
}

/*
 * The grep cache (grepcache.py): sandlot_grep_fill walks a tree as sandlot_grep does
 * and keeps what a search of it needs, a "pack"; sandlot_grep_pack searches a pack and
 * writes exactly what sandlot_grep writes for the same tree.
 *
 * A pack holds one record per regular file, in walk order:
 *   u32 path length, the path below the directory (JSON-escaped, with its leading '/');
 *   u32 name length, the name (raw bytes, for the glob);
 *   u8 kind: 0 text, 1 binary (a NUL byte: skipped), 2 UTF-16 with a byte order mark;
 *   u64 length and bytes of the text (0 for the other kinds).
 *
 * Each directory is watched (inotify_add_watch on `ifd` with `mask`) before it is listed,
 * and each file before it is read: any change after its copy was taken is an event on
 * one of the watches returned (`wds`).
 */

struct pack_result {
    unsigned char *pack;
    size_t len;
    int *wds;          /* the watches taken, also on failure (the caller releases them) */
    size_t nwds;
    int unwatched;     /* 1: a watch could not be taken (the copy is right, but not kept) */
    int status;        /* as sandlot_grep's */
};

/* Records a watch taken (wd >= 0), or that one could not be. */
static void took_watch(struct grep_job *job, int wd) {
    if (wd < 0) {
        job->unwatched = 1;
        return;
    }
    if (job->nwds == job->wds_cap) {
        size_t cap = job->wds_cap ? 2 * job->wds_cap : 64;
        int *p = realloc(job->wds, cap * sizeof *p);
        if (p == NULL) {
            inotify_rm_watch(job->ifd, wd); /* possibly another copy's: it only drops more */
            job->status = -ENOMEM;
            return;
        }
        job->wds = p;
        job->wds_cap = cap;
    }
    job->wds[job->nwds++] = wd;
}

/* Watches the directory dfd. With by_cwd, it also becomes the thread's working directory,
 * so that its files are watched by name (watch_file): a lookup through /proc/self/fd
 * costs several times a watch. */
static void watch_dir(struct grep_job *job, int dfd) {
    if (job->by_cwd) {
        took_watch(job, fchdir(dfd) == 0 ? inotify_add_watch(job->ifd, ".", job->mask) : -1);
        return;
    }
    char path[40];
    snprintf(path, sizeof path, "/proc/self/fd/%d", dfd);
    took_watch(job, inotify_add_watch(job->ifd, path, job->mask));
}

/* Watches the file `name` of the directory being walked, opened as fd. By name, the watch
 * could land on another file if the name were replaced meanwhile: that replacement is an
 * event on the directory's own watch, taken before it was listed. */
static void watch_file(struct grep_job *job, const char *name, int fd) {
    if (job->by_cwd) {
        took_watch(job, inotify_add_watch(job->ifd, name, job->mask | IN_DONT_FOLLOW));
        return;
    }
    char path[40];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    took_watch(job, inotify_add_watch(job->ifd, path, job->mask));
}

static void put_u32(struct buf *b, size_t v) {
    uint32_t x = (uint32_t)v;
    put(b, (const char *)&x, sizeof x);
}

static void put_record(struct grep_job *job, const char *name, size_t name_len,
                       unsigned char kind, const unsigned char *data, size_t len) {
    struct buf *b = &job->pack;
    if (reserve(b, job->path.len + name_len + len + 32) != 0) {
        job->status = -ENOMEM;
        return;
    }
    put_u32(b, job->path.len);
    put(b, job->path.data, job->path.len);
    put_u32(b, name_len);
    put(b, name, name_len);
    put(b, (const char *)&kind, 1);
    uint64_t n = kind == 0 ? (uint64_t)len : 0;
    put(b, (const char *)&n, sizeof n);
    if (n) put(b, (const char *)data, len);
}

/* walk()'s search, keeping every file instead of searching it. */
static void fill_walk(struct grep_job *job, int dfd, int depth) {
    if (depth > MAX_DEPTH) {
        job->status = 1;
        return;
    }
    watch_dir(job, dfd);
    size_t n;
    int oom = 0, big = 0;
    struct name *list = entries(dfd, &n, &oom, &big);
    if (oom) {
        job->status = -ENOMEM;
        return;
    }
    if (big) {
        job->status = 1; /* not a tree to keep in memory */
        return;
    }
    size_t dir_len = job->path.len;
    for (size_t i = 0; i < n && job->status == 0; i++) {
        const char *s = list[i].s;
        if (strcmp(s, ".git") == 0) continue;
        int is_reg = 0;
        int is_dir = is_dir_entry(dfd, &list[i], &is_reg);
        if (is_dir < 0 || (!is_dir && !is_reg)) continue;
        size_t sn = strlen(s);
        if (push_name(job, dir_len, s, sn) != 0) break;
        if (is_dir) {
            int sub = openat(dfd, s, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (sub < 0) continue; /* raced away or unreadable: skipped */
            fill_walk(job, sub, depth + 1);
            close(sub);
            if (job->by_cwd && fchdir(dfd) != 0) job->unwatched = 1;
            continue;
        }
        int fd = openat(dfd, s, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
        if (fd < 0) continue;
        watch_file(job, s, fd);
        long long len = read_file(job, fd);
        close(fd);
        if (len < 0) continue;
        put_record(job, s, sn, file_kind(job->data, (size_t)len), job->data, (size_t)len);
    }
    job->path.len = dir_len;
    free_entries(list, n);
}

/* With by_cwd, the calling thread gets its own working directory (unshare(CLONE_FS)) once,
 * changes it while walking, and leaves it at "/". */
int sandlot_grep_fill(int fd, int ifd, uint32_t mask, long max_files, long long max_bytes,
                      int by_cwd, struct pack_result *out) {
    static __thread int own_cwd;
    memset(out, 0, sizeof *out);
    struct grep_job job = {0};
    if (by_cwd && !own_cwd && unshare(CLONE_FS) == 0) own_cwd = 1;
    job.by_cwd = by_cwd && own_cwd;
    job.ifd = ifd;
    job.mask = mask;
    job.count_left = max_files;
    job.files_left = max_files;
    job.bytes_left = max_bytes;
    walk(&job, fd, 0, 0); /* count first: a large tree is left before any read or watch */
    if (job.status == 0) {
        /* An empty path: records hold paths below the directory. */
        if (reserve(&job.path, 1) != 0)
            job.status = -ENOMEM;
        else
            fill_walk(&job, fd, 0);
        if (job.by_cwd && chdir("/") != 0) job.unwatched = 1;
    }
    free(job.path.data);
    free(job.data);
    out->wds = job.wds;
    out->nwds = job.nwds;
    out->unwatched = job.unwatched;
    out->status = job.status;
    if (job.status != 0) {
        free(job.pack.data);
        return job.status;
    }
    out->pack = (unsigned char *)job.pack.data;
    out->len = job.pack.len;
    return 0;
}

void sandlot_grep_fill_free(struct pack_result *r) {
    free(r->pack);
    free(r->wds);
    r->pack = NULL;
    r->wds = NULL;
}

static uint64_t get_u(const unsigned char *p, size_t n) {
    uint32_t a;
    uint64_t b;
    if (n == 4) {
        memcpy(&a, p, 4);
        return a;
    }
    memcpy(&b, p, 8);
    return b;
}

int sandlot_grep_pack(const unsigned char *pack, size_t len, const char *base, size_t base_len,
                      const char *pattern, size_t pattern_len, const char *glob,
                      size_t glob_len, long cap, struct grep_result *out) {
    memset(out, 0, sizeof *out);
    struct grep_job job = {0};
    job.pattern = (const unsigned char *)pattern;
    job.pattern_len = pattern_len;
    job.glob = (const unsigned char *)glob;
    job.glob_len = glob_len;
    job.cap = cap;
    if (reserve(&job.path, base_len + 1) != 0) {
        out->status = -ENOMEM;
        return -ENOMEM;
    }
    put(&job.path, base, base_len);
    size_t at = 0;
    while (at < len && job.status == 0 && job.count <= job.cap) {
        size_t path_len = get_u(pack + at, 4);
        const unsigned char *path = pack + at + 4;
        at += 4 + path_len;
        size_t name_len = get_u(pack + at, 4);
        const unsigned char *name = pack + at + 4;
        at += 4 + name_len;
        unsigned char kind = pack[at];
        size_t data_len = get_u(pack + at + 1, 8);
        const unsigned char *data = pack + at + 9;
        at += 9 + data_len;
        if (job.glob != NULL && !glob_match(job.glob, job.glob_len, name, name_len)) continue;
        if (kind == 2) {
            job.status = 1; /* UTF-16 with a byte order mark: ripgrep transcodes it */
            break;
        }
        if (kind == 1) continue;
        job.path.len = base_len;
        if (reserve(&job.path, path_len) != 0) {
            job.status = -ENOMEM;
            break;
        }
        put(&job.path, (const char *)path, path_len);
        scan(&job, data, data_len, job.path.len);
    }
    free(job.path.data);
    return finish(&job, out);
}
