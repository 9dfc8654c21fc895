//! `report.html`: the run's summary and figures in one page that opens in
//! any browser, beside the PNGs it shows (no scripts or styles from
//! elsewhere).
//!
//! The summary is markdown of a small, known shape (headings, tables,
//! paragraphs, a quote, images); this renders exactly that. A script in the
//! page records, once it has loaded, how many of its images did load
//! (`data-images-loaded="k/n"` on the body), which the tests read through a
//! headless browser.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// `**bold**` and `` `code` `` inside escaped text.
fn inline(s: &str) -> String {
    let mut out = String::new();
    let mut bold = false;
    let mut code = false;
    let e = escape(s);
    let mut rest = e.as_str();
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("**") {
            out.push_str(if bold { "</strong>" } else { "<strong>" });
            bold = !bold;
            rest = r;
        } else if let Some(r) = rest.strip_prefix('`') {
            out.push_str(if code { "</code>" } else { "<code>" });
            code = !code;
            rest = r;
        } else {
            let c = rest.chars().next().unwrap_or(' ');
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    if code {
        out.push_str("</code>");
    }
    if bold {
        out.push_str("</strong>");
    }
    out
}

/// A markdown table line as an HTML row of `tag` cells.
fn row(line: &str, tag: &str) -> String {
    let t = line.trim().trim_start_matches('|').trim_end_matches('|');
    let cells: String = t
        .split('|')
        .map(|c| format!("<{tag}>{}</{tag}>", inline(c.trim())))
        .collect();
    format!("<tr>{cells}</tr>")
}

/// The summary's markdown as HTML.
pub fn markdown_to_html(md: &str) -> String {
    let mut html = String::new();
    let mut lines = md.lines().peekable();
    let mut para: Vec<&str> = Vec::new();
    let flush = |para: &mut Vec<&str>, html: &mut String| {
        if !para.is_empty() {
            let _ = writeln!(html, "<p>{}</p>", inline(&para.join(" ")));
            para.clear();
        }
    };
    while let Some(line) = lines.next() {
        let t = line.trim();
        if t.is_empty() {
            flush(&mut para, &mut html);
        } else if let Some(h) = t.strip_prefix("## ") {
            flush(&mut para, &mut html);
            let _ = writeln!(html, "<h2>{}</h2>", inline(h));
        } else if let Some(h) = t.strip_prefix("# ") {
            flush(&mut para, &mut html);
            let _ = writeln!(html, "<h1>{}</h1>", inline(h));
        } else if let Some(q) = t.strip_prefix("> ") {
            flush(&mut para, &mut html);
            let _ = writeln!(html, "<blockquote>{}</blockquote>", inline(q));
        } else if let Some(img) = t.strip_prefix("![") {
            flush(&mut para, &mut html);
            let (alt, src) = img.split_once("](").unwrap_or((img, ""));
            let src = src.trim_end_matches(')');
            let _ = writeln!(
                html,
                "<figure><img src=\"{}\" alt=\"{}\"><figcaption>{}</figcaption></figure>",
                escape(src),
                escape(alt),
                escape(alt)
            );
        } else if t.starts_with('|') {
            flush(&mut para, &mut html);
            let _ = writeln!(html, "<table>");
            let _ = writeln!(html, "{}", row(t, "th"));
            while let Some(next) = lines.peek().map(|l| l.trim()) {
                if !next.starts_with('|') {
                    break;
                }
                lines.next();
                if next.chars().all(|c| matches!(c, '|' | '-' | ':' | ' ')) {
                    continue;
                }
                let _ = writeln!(html, "{}", row(next, "td"));
            }
            let _ = writeln!(html, "</table>");
        } else {
            para.push(t);
        }
    }
    flush(&mut para, &mut html);
    html
}

const STYLE: &str = "body{font-family:sans-serif;max-width:1300px;margin:2em auto;padding:0 1em;color:#222}\
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #bbb;padding:.3em .6em;text-align:left}\
th{background:#eee}blockquote{border-left:4px solid #d62728;margin:1em 0;padding:.5em 1em;background:#fff4f4}\
figure{margin:1.5em 0}img{max-width:100%;border:1px solid #ddd}code{background:#f4f4f4;padding:0 .2em}";

const SCRIPT: &str = "window.addEventListener('load',function(){var i=document.images,k=0;\
for(var j=0;j<i.length;j++){if(i[j].complete&&i[j].naturalWidth>0)k++;}\
document.body.setAttribute('data-images-loaded',k+'/'+i.length);});";

/// Write `report.html` into `dir`; its path.
pub fn write(dir: &Path, summary_md: &str) -> std::io::Result<PathBuf> {
    let title = summary_md
        .lines()
        .find_map(|l| l.strip_prefix("# "))
        .unwrap_or("azsdp bench");
    let page = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>{}</title><style>{STYLE}</style><script>{SCRIPT}</script></head>\n<body>\n{}</body></html>\n",
        escape(title),
        markdown_to_html(summary_md)
    );
    let path = dir.join("report.html");
    std::fs::write(&path, page)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summarys_shapes_become_html() {
        let md = "# azsdp bench --quick\n\nRan in 3 s.\nOn <this> host.\n\n\
                  > **Warning: busy**\n\n| a | b |\n|---|---|\n| 1 | **met** |\n\n\
                  ## Figures\n\n![fig6.png](fig6.png)\n";
        let h = markdown_to_html(md);
        assert!(h.contains("<h1>azsdp bench --quick</h1>"), "{h}");
        assert!(
            h.contains("<p>Ran in 3 s. On &lt;this&gt; host.</p>"),
            "{h}"
        );
        assert!(h.contains("<blockquote><strong>Warning: busy</strong></blockquote>"));
        assert!(h.contains("<tr><th>a</th><th>b</th></tr>"), "{h}");
        assert!(
            h.contains("<tr><td>1</td><td><strong>met</strong></td></tr>"),
            "{h}"
        );
        assert!(!h.contains("---"), "{h}");
        assert!(h.contains("<img src=\"fig6.png\" alt=\"fig6.png\">"), "{h}");
    }
}
